# A stand-in for the compose stack's redis image where no image registry is reachable
# (tests/test_container.py): Debian's redis-server from a debootstrap root (ROOTFS). Like the
# official image it serves other containers, so protected mode (which refuses every non-loopback
# client of a password-less redis-server started without a config file) is off; compose's own
# `command:` (redis-server and its flags) is passed through.
ARG ROOTFS=uibus-standin/trixie
FROM ${ROOTFS}
RUN printf '#!/bin/sh\nexec "$@" --protected-mode no\n' > /usr/local/bin/standin && chmod +x /usr/local/bin/standin \
    && mkdir -p /data
WORKDIR /data
ENTRYPOINT ["/usr/local/bin/standin"]
CMD ["redis-server"]
