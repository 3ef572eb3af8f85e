"""Load tests: sessions in flight against a pair or a fleet (`kvtool bench --load`)."""
