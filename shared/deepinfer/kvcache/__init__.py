"""The KV block store: its storage engine (`store`), a worker's client of it (`client`) and which shard holds a
block (`rendezvous`). Which block is which (hashes, layout id) is `deepinfer.hashing`, below `protocol`."""
