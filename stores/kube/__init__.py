"""The Kubernetes datastore: ``client`` (tabby's Kubernetes API client), ``kinds`` (where
each of tabby's kinds lives on the API), ``store`` (the store protocol on it), ``sync`` (its
list-and-watch)."""
