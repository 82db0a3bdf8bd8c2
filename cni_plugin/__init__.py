"""tabby: the CNI interface plugin (veth pair, /32 and /128 routes, proxy ARP/NDP gateway).

``plugin`` holds its verbs (ADD, DEL, CHECK, GC, STATUS), ``config`` its conflist section.
"""
