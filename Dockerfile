# ckptfs gateway / drain / lifecycle image, used by the Helm chart in helm/ckptfs.
#   docker build -t ckptfs:0.1.0 .
# The image runs as root: the gateway mounts FUSE from a privileged DaemonSet pod.
# The chart's lifecycle CronJob runs the same image as an unprivileged user.
FROM debian:12

ENV DEBIAN_FRONTEND=noninteractive
COPY . /opt/ckptfs
WORKDIR /opt/ckptfs
# The README's set-up: apt packages (fuse3, ...), a venv in .venv, the package. A .venv copied
# from the build context would point at the builder's Python: always start from a fresh one.
RUN rm -rf .venv \
    && scripts/setup.sh \
    && rm -rf /var/lib/apt/lists/* /root/.cache/pip
ENV PATH=/opt/ckptfs/.venv/bin:$PATH
ENTRYPOINT ["ckptfs"]
CMD ["--help"]
