"""Routing between nodes: tabby-node's routing work, BIRD, a 3-node lab's convergence."""
