# A stand-in for python:3.11-slim where no image registry is reachable (tests/test_container.py):
# Debian bookworm's own Python 3.11 from a debootstrap root (imported as ROOTFS), with `python`
# and `pip` on PATH the way the official image has them (a venv made with Debian's python3-venv).
ARG ROOTFS=uibus-standin/bookworm
FROM ${ROOTFS}
ENV LANG=C.UTF-8 PATH=/usr/local/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
RUN python3 -m venv /usr/local/python && python --version && pip --version
CMD ["python3"]
