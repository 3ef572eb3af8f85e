"""The store: its interface, the Mooncake backend and its segment, and the wrappers a stack is
built from (time-outs, one key once a batch, the breaker, late connection, counters, faults);
``stack.open_store_stack`` builds it."""
