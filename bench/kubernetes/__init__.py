"""tabby on a real Kubernetes."""
