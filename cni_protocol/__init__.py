"""The CNI protocol layer shared by both binaries (the "skel"): stdlib only, no I/O of its own."""
