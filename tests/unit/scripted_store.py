"""A dict-backed store with scripted faults, for forcing failures the real store cannot produce on cue."""

from __future__ import annotations

from connector.store.store import PutOutcome, StoreError


class ScriptedStore:
    def __init__(self):
        self.objects: dict[str, bytes] = {}
        self.fail_exists = False
        self.fail_get = False
        self.put_outcome_for = lambda key: PutOutcome.STORED  # key -> outcome
        self.registered: list[tuple[int, int]] = []

    def exists(self, keys):
        if self.fail_exists:
            raise StoreError("existence query timed out after 2 s")
        return [key in self.objects for key in keys]

    def get(self, keys, object_bytes=0):
        if self.fail_get:
            raise StoreError("object load failed: transfer failed (-800)")
        return [self.objects.get(key) for key in keys]

    def put(self, key, value):
        outcome = self.put_outcome_for(key)
        if outcome is PutOutcome.STORED:
            self.objects.setdefault(key, bytes(value))  # first put wins
        return outcome

    def put_many(self, items, replace=False):
        if replace:
            for key, _ in items:
                self.objects.pop(key, None)
        outcomes = [self.put(key, value) for key, value in items]
        return next((o for o in outcomes if o is not PutOutcome.STORED), PutOutcome.STORED)

    def register(self, address, nbytes):
        self.registered.append((address, nbytes))

    def get_into(self, keys, regions, lease):
        if self.fail_get:
            raise StoreError("object load failed: transfer failed (-800)")
        counts = []
        for key, region in zip(keys, regions, strict=True):
            value = self.objects.get(key)
            if value is None or len(value) > len(region.view):
                counts.append(-704)  # not found (Mooncake's code); a value too large fails alike
                continue
            region.view[: len(value)] = value
            counts.append(len(value))
        return counts

    def put_from(self, items, lease):
        return [self.put(key, bytes(region.view)) for key, region in items]

    def close(self):
        pass


class RepeatedKeyStore(ScriptedStore):
    """Answers a batch that names a key twice the way Mooncake 0.3.13.post1's client does (measured
    against a real master): success at full length for every slot, but only the key's last slot holds
    its bytes; the earlier ones hold other bytes (the client's: another key's, zeros, or the region
    left as it was; zeros here). Records every batch that named a key twice, as (call, keys), in
    ``repeated``: a store under ``UniqueKeysStore`` must never see one."""

    def __init__(self):
        super().__init__()
        self.repeated: list[tuple[str, list[str]]] = []

    def _note(self, call, keys) -> set[int]:
        """Record a batch with a repeated key; the positions of each repeated key but its last."""
        keys = list(keys)
        last = {key: position for position, key in enumerate(keys)}
        spoiled = {position for position, key in enumerate(keys) if last[key] != position}
        if spoiled:
            self.repeated.append((call, keys))
        return spoiled

    def exists(self, keys):
        self._note("exists", keys)
        return super().exists(keys)

    def get(self, keys, object_bytes=0):
        spoiled = self._note("get", keys)
        values = super().get(keys, object_bytes)
        return [bytes(len(v)) if v is not None and i in spoiled else v for i, v in enumerate(values)]

    def get_into(self, keys, regions, lease):
        spoiled = self._note("get_into", keys)
        counts = super().get_into(keys, regions, lease)
        for position in spoiled:
            if counts[position] > 0:
                regions[position].view[: counts[position]] = bytes(counts[position])
        return counts

    def put_many(self, items, replace=False):
        self._note("put_many", [key for key, _ in items])
        return super().put_many(items, replace)

    def put_from(self, items, lease):
        self._note("put_from", [key for key, _ in items])
        return super().put_from(items, lease)


class CountingStore(ScriptedStore):
    """Counts its existence queries (the round trips a lookup made)."""

    def __init__(self):
        super().__init__()
        self.queries = 0

    def exists(self, keys):
        self.queries += 1
        return super().exists(keys)


class InlineCalls:
    """A stand-in for ``connector.calls.BoundedCalls`` that runs each call at once, on the caller's
    thread: the background job has answered by the time ``submit`` returns."""

    def __init__(self):
        self.submitted = 0

    def submit(self, fn, what):
        import concurrent.futures

        self.submitted += 1
        future = concurrent.futures.Future()
        try:
            future.set_result(fn())
        except Exception as exc:  # noqa: BLE001 - handed to the caller through the future
            future.set_exception(exc)
        return future
