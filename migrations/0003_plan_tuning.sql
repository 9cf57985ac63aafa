-- cacheroute results store, schema version 3 (see docs/store.md): what a CacheRoute control
-- loop planned with — q_cap and warm slots W — and, when it tuned them itself, one line saying
-- what it compared and why. NULL for plans stored by earlier versions.

ALTER TABLE plans ADD COLUMN q_cap REAL;
ALTER TABLE plans ADD COLUMN warm_slots INTEGER;
ALTER TABLE plans ADD COLUMN tuning TEXT;
