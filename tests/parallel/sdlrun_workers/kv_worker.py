"""Two ranks exchange values through the rendezvous store with KVStoreClient (no core)."""

import os

from spark_dl.rendezvous.client import client_from_env

rank = int(os.environ["SDL_RANK"])
peer = 1 - rank
client = client_from_env()
assert client is not None, "no rendezvous environment"
with client:
    client.set("test", f"rank/{rank}:value", f"hello from {rank}".encode())
    value = client.get("test", f"rank/{peer}:value", timeout=20)
print(f"got {value.decode()!r}", flush=True)
