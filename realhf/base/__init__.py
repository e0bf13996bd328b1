"""The ground floor: logging, name_resolve, network, topology, stats (and the training steps' stats tracker), processes, the
run secret and the wire format."""
