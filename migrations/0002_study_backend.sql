-- cacheroute results store, schema version 2 (see docs/store.md): the backend a study runs on
-- (`sim`, `local`, `ssh`), recorded when the study is created, so that a resume on another
-- backend is refused instead of mixing measurements. NULL for studies created by version 1;
-- for those the stored spec's `backend:` is what they ran on unless overridden.

ALTER TABLE studies ADD COLUMN backend TEXT;
