//! A blocking facade over [`Store`] for synchronous callers (the simulator runner): it owns a
//! current-thread tokio runtime and blocks on each call. Same methods, same errors.
//! Must not be used from inside an async runtime (tokio forbids nested `block_on`); async
//! callers use [`Store`] directly.

use std::collections::BTreeSet;
use std::path::Path;

use super::{
    RequestRow, Result, RunHandle, RunId, Store, StoreError, StoredStudy, StudyHandle, StudyId,
    StudySummary, TelemetrySample,
};
use crate::analysis::model::{RunKey, StepMetrics};
use crate::analysis::record::PlanRecord;

/// [`Store`] with blocking methods. Dropping it closes the pool (checkpointing the WAL).
#[derive(Debug)]
pub struct BlockingStore {
    pub(super) store: Store,
    pub(super) runtime: tokio::runtime::Runtime,
}

impl BlockingStore {
    /// See [`Store::open`].
    pub fn open(path: impl AsRef<Path>) -> Result<BlockingStore> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(StoreError::Runtime)?;
        let store = runtime.block_on(Store::open(path))?;
        Ok(BlockingStore { store, runtime })
    }

    /// The async store inside (for callers that own a runtime elsewhere).
    pub fn as_async(&self) -> &Store {
        &self.store
    }

    /// See [`Store::path`].
    pub fn path(&self) -> &Path {
        self.store.path()
    }

    /// See [`Store::create_or_get_study`].
    pub fn create_or_get_study(
        &self,
        name: &str,
        spec: &str,
        backend: &str,
    ) -> Result<StudyHandle> {
        self.runtime
            .block_on(self.store.create_or_get_study(name, spec, backend))
    }

    /// See [`Store::create_or_get_run`].
    pub fn create_or_get_run(
        &self,
        study: StudyId,
        key: &RunKey,
        config: &str,
    ) -> Result<RunHandle> {
        self.runtime
            .block_on(self.store.create_or_get_run(study, key, config))
    }

    /// See [`Store::completed_steps`].
    pub fn completed_steps(&self, run: RunId) -> Result<BTreeSet<usize>> {
        self.runtime.block_on(self.store.completed_steps(run))
    }

    /// See [`Store::record_step`].
    pub fn record_step(
        &self,
        run: RunId,
        step: usize,
        metrics: &StepMetrics,
        requests: &[RequestRow],
        plans: &[PlanRecord],
    ) -> Result<()> {
        self.runtime
            .block_on(self.store.record_step(run, step, metrics, requests, plans))
    }

    /// See [`Store::mark_run_complete`].
    pub fn mark_run_complete(&self, run: RunId) -> Result<()> {
        self.runtime.block_on(self.store.mark_run_complete(run))
    }

    /// See [`Store::insert_telemetry`].
    pub fn insert_telemetry(&self, study: StudyId, batch: &[TelemetrySample]) -> Result<()> {
        self.runtime
            .block_on(self.store.insert_telemetry(study, batch))
    }

    /// See [`Store::load_telemetry`].
    pub fn load_telemetry(
        &self,
        study: StudyId,
        metric: Option<&str>,
    ) -> Result<Vec<TelemetrySample>> {
        self.runtime
            .block_on(self.store.load_telemetry(study, metric))
    }

    /// See [`Store::load_requests`].
    pub fn load_requests(&self, run: RunId, step: usize) -> Result<Vec<RequestRow>> {
        self.runtime.block_on(self.store.load_requests(run, step))
    }

    /// See [`Store::list_studies`].
    pub fn list_studies(&self) -> Result<Vec<StudySummary>> {
        self.runtime.block_on(self.store.list_studies())
    }

    /// See [`Store::load_study`].
    pub fn load_study(&self, name: &str) -> Result<StoredStudy> {
        self.runtime.block_on(self.store.load_study(name))
    }
}

impl Drop for BlockingStore {
    fn drop(&mut self) {
        self.runtime.block_on(self.store.close());
    }
}
