"""The host tier: one copy of the frozen weights per node in shared host memory, and host
memory for activations.

  store.py    the node handshake of the host store (who creates, who attaches, the parallel fill)
  sources.py  which source fills a missing chunk (peers or the store), the store's layout, the
              host -> page copies
  offload.py  activation offload: a bounded, recycled host buffer pool for saved activations
"""
