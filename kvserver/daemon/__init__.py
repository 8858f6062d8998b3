"""The kvserver daemon process: configuration, the transport-independent service, the ZMQ and
gRPC front ends, and the process wiring (``process.py`` is the only module that knows it is a
process)."""
