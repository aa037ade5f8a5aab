"""The domain core: what uibus does, as plain async objects with domain errors.

The UI feed, the extension-UI dialogs and the chat turn live here and know nothing of transports:
the gRPC servicers, the webview mux and the CodeBolt gateway all call these objects directly, so
one behaviour reaches every way in. `Core` is the set of them one app owns.
"""
