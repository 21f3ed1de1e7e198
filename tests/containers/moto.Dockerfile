# moto's S3 server for the containers tier, on the same local base as the image under test
# (no image registry needed). The pip settings are the build machine's, as for the image.
ARG BASE
FROM ${BASE}
ARG PIP_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_EXTRA_INDEX_URL
ARG PIP_CONSTRAINT
ARG PIP_CERT
ARG MOTO_REQUIREMENTS
RUN python3 -m venv /opt/moto \
    && /opt/moto/bin/pip install --no-cache-dir --disable-pip-version-check $MOTO_REQUIREMENTS
EXPOSE 5000
ENTRYPOINT ["/opt/moto/bin/moto_server", "-H", "0.0.0.0", "-p", "5000"]
