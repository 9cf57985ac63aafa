//! The workload of a study's runs and each step's inputs: the spec's trace (read once,
//! replayed at each step's rate) or its generator (loaded once per distinct one), and from it
//! a step's records, block size, warm start and key rates.

use super::spec::{RunPlan, Spec};
use crate::policy::calibrate::{warm_start, WarmStart};
use crate::workload::gen::{resolve, Workload};
use crate::workload::trace::{ReaderOptions, TraceReader, TraceRecord};
use anyhow::{bail, Context, Result};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

/// The workload of a run, loaded once and shared by its steps.
pub(super) enum Source {
    Generated(Box<Workload>),
    Trace {
        records: Arc<Vec<TraceRecord>>,
        native_qps: f64,
    },
}

fn load_trace(path: &Path) -> Result<(Vec<TraceRecord>, f64)> {
    let f = std::fs::File::open(path)
        .with_context(|| format!("workload.trace: cannot open {}", path.display()))?;
    let mut v = Vec::new();
    for r in TraceReader::new(std::io::BufReader::new(f), ReaderOptions::default()) {
        v.push(r.with_context(|| format!("workload.trace {}", path.display()))?);
    }
    if v.len() < 2 {
        bail!(
            "workload.trace {}: needs at least two requests",
            path.display()
        );
    }
    let span = (v.last().unwrap().timestamp_ms - v[0].timestamp_ms) / 1000.0;
    let native = if span > 0.0 {
        (v.len() - 1) as f64 / span
    } else {
        1.0
    };
    Ok((v, native))
}

/// Each run's workload: the spec's trace, or its generator (loaded once per distinct one).
pub(super) fn load_sources(
    spec: &Spec,
    plans: &[RunPlan],
    base_dir: &Path,
) -> Result<Vec<Arc<Source>>> {
    let mut sources: Vec<Arc<Source>> = Vec::with_capacity(plans.len());
    let mut cache: HashMap<String, Arc<Source>> = HashMap::new();
    let trace = match &spec.workload.trace {
        Some(p) => {
            let (v, native) = load_trace(&resolve(base_dir, p))?;
            Some(Arc::new(Source::Trace {
                records: Arc::new(v),
                native_qps: native,
            }))
        }
        None => None,
    };
    for p in plans {
        let src = match (&trace, &p.generator) {
            (Some(t), _) => t.clone(),
            (None, Some(g)) => {
                let g = g.relative_to(base_dir);
                let k = yaml_serde::to_string(&g).unwrap_or_default();
                match cache.get(&k) {
                    Some(s) => s.clone(),
                    None => {
                        let wl =
                            Workload::load(&g).with_context(|| "workload.generator".to_string())?;
                        let s = Arc::new(Source::Generated(Box::new(wl)));
                        cache.insert(k, s.clone());
                        s
                    }
                }
            }
            (None, None) => bail!("workload: give `generator` or `trace`"),
        };
        sources.push(src);
    }
    Ok(sources)
}

/// A step's inputs: the trace (model time, starting at 0), its block size, the control loop's
/// warm start (generated workloads) and every key's expected rate (for fairness deciles).
pub struct StepInputs {
    pub block: u32,
    pub records: Box<dyn Iterator<Item = TraceRecord>>,
    pub warm: Option<WarmStart>,
    pub key_rates: HashMap<u64, f64>,
}

/// The inputs of a step of a generated workload: `duration_s` seconds at `qps` with `seed`, the
/// generator's expected rates as the control loop's warm start and as the keys' rates.
pub fn generated_inputs(wl: &Workload, qps: f64, duration_s: f64, seed: u64) -> Result<StepInputs> {
    let key_rates: HashMap<u64, f64> = wl
        .expected_rates(qps, seed)
        .into_iter()
        .filter(|r| r.rate > 0.0)
        .map(|r| (crate::key_hash(&r.key), r.rate))
        .collect();
    Ok(StepInputs {
        block: wl.config().prefix.block_size,
        records: Box::new(wl.generate(qps, duration_s, seed)?),
        warm: Some(warm_start(wl, qps, seed)?),
        key_rates,
    })
}

pub(super) fn step_inputs(spec: &Spec, seed: u64, src: &Source, qps: f64) -> Result<StepInputs> {
    let duration = spec.warmup_s + spec.measure_s;
    Ok(match src {
        Source::Generated(wl) => generated_inputs(wl, qps, duration, seed)?,
        Source::Trace {
            records,
            native_qps,
        } => {
            let f = native_qps / qps;
            let t0 = records[0].timestamp_ms;
            let recs: Vec<TraceRecord> = records
                .iter()
                .map(|r| TraceRecord {
                    timestamp_ms: (r.timestamp_ms - t0) * f,
                    ..r.clone()
                })
                .take_while(|r| r.timestamp_ms / 1000.0 < duration)
                .collect();
            let mut key_rates: HashMap<u64, f64> = HashMap::new();
            for r in &recs {
                *key_rates.entry(crate::key_hash(&r.key)).or_default() += 1.0 / duration;
            }
            StepInputs {
                block: spec.workload.trace_block_size.unwrap_or(512),
                records: Box::new(recs.into_iter()),
                warm: None,
                key_rates,
            }
        }
    })
}
