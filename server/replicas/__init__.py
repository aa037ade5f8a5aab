"""The replicas wing: where each hosted agent runs and how what one replica holds reaches the others.

The domain (uibus.domain) asks one `Placement` (uibus.replicas.placement) and never whether it is
replicated: `LocalPlacement` when one process is all there is (every agent runs here, memory is
exact, no bus traffic), `LeasedPlacement` with replicas on Redis (an agent's lease names its one
owner, turns and steering are carried to it, waiting dialogs and agent states are shared through
the store, answers are forwarded to the dialog's holder). The parts of the leased one:

* ownership: the agent leases held here, renewed and fenced;
* turn_forwarding: turns and steering calls carried to the owner and served there;
* dialog_forwarding: extension-UI answers carried to the replica holding the dialog;
* asking: request and reply over the bus, the one way the three above carry work to a replica;
* dialog_sharing: waiting dialogs written to the store for UIs on other replicas;
* agent_state_sharing: hosted agents' states written to the store for the other replicas' listings.

Layering: this package sits between the hosted agents and the domain. It uses the bus, the store
and the wire kinds, never the domain: what it runs on the domain's behalf (a turn here, a steering
call here, an answer applied here, the agents open here) the domain objects hand to the placement
when they are built (`serve_*`, `host`).
"""
