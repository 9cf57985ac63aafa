-- cacheroute results store, schema version 4 (see docs/store.md): whether a CacheRoute plan's
-- sets were bounded (1) or pinned (0), as the control loop resolved it with q_cap and W. NULL
-- for plans stored by earlier versions and for a plan read from a file.

ALTER TABLE plans ADD COLUMN bounded_sets INTEGER;
