"""NetworkPolicy: programming, per event, across a cluster, on the data path."""
