"""The runtime: master worker, model workers and the control plane between them (ZMQ request/reply
stream, heartbeats). Import the submodules directly; this package imports nothing eagerly."""
