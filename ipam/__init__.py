"""tabby-ipam: block IPAM (pools cut into node-affine blocks, handles per attachment)."""
