# A stand-in for the compose stack's nginx image where no image registry is reachable
# (tests/test_container.py): Debian's nginx (1.26 in trixie: `http2 on;` needs 1.25.1) from a
# debootstrap root (ROOTFS), run in the foreground as the official image runs it; compose mounts
# deploy/nginx/nginx.conf over /etc/nginx/nginx.conf.
ARG ROOTFS=uibus-standin/trixie
FROM ${ROOTFS}
RUN ln -sf /dev/stdout /var/log/nginx/access.log && ln -sf /dev/stderr /var/log/nginx/error.log
STOPSIGNAL SIGQUIT
CMD ["nginx", "-g", "daemon off;"]
