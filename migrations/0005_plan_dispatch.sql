-- cacheroute results store, schema version 5 (see docs/store.md): the dispatch a CacheRoute
-- plan was in force with (`plan+chwbl+prefill`, `reactive+prefix+prefill`, …), as the control
-- loop resolved it with q_cap, W and bounded sets. NULL for plans stored by earlier versions and
-- for a plan read from a file.

ALTER TABLE plans ADD COLUMN dispatch TEXT;
