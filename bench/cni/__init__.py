"""CNI calls as a runtime makes them: per call, per datastore, the dataplane's share."""
