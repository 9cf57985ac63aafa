//! What a local step's clients send to: our router (`cacheroute route` as a child process,
//! configured as the simulated study would run the policy, with the fleet's engine model and
//! time scale, a warm start planned the simulator's way, and an admin token by which the
//! runner reads back the plans it installed) or a peer router.

use super::child::{spawn_listening, ChildGuard, START_TIMEOUT};
use super::spec::{RunPlan, Spec, StudyPolicy};
use crate::analysis::record::PlanRecord;
use crate::bounds::TimeScale;
use crate::router::{PolicySetting, RouterSettings};
use anyhow::{bail, Context, Result};

/// A warm start for the router: the previous period's per-key rates (by name) and the mean
/// request shape, planned and installed at start as in the simulator.
pub struct RouterWarmStart {
    pub rates: Vec<crate::workload::rates::KeyRate>,
    pub mean_prompt_tokens: f64,
    pub mean_output_tokens: f64,
}

/// A token for the step's router's admin API (loopback only; it guards nothing a study needs
/// kept, but the router serves `/admin` only with one).
pub(super) fn admin_token(seed: u64) -> String {
    use std::hash::BuildHasher;
    let h = std::collections::hash_map::RandomState::new().hash_one((seed, std::process::id()));
    format!("study-{h:016x}")
}

/// The records of the plans the step's router installed (`/admin/plan?history=true`), their
/// times moved from the router's start to the replay's (`offset_s` model seconds later), as
/// the simulator's plans are timed; a plan installed before the replay started (a warm start's)
/// is at 0.
pub(super) fn router_plans(
    client: &reqwest::blocking::Client,
    url: &str,
    token: &str,
    offset_s: f64,
) -> Result<Vec<PlanRecord>> {
    let body = client
        .get(format!("{url}/admin/plan?history=true"))
        .bearer_auth(token)
        .send()
        .and_then(|r| r.error_for_status())
        .and_then(|r| r.bytes())
        .with_context(|| format!("reading the plans the router at {url} installed"))?;
    let v: serde_json::Value = serde_json::from_slice(&body)
        .with_context(|| format!("the router at {url} answered its plans with no JSON"))?;
    let dropped = v["history_dropped"].as_u64().unwrap_or(0);
    if dropped > 0 {
        tracing::warn!(
            "the router kept the last plans only: {dropped} earlier ones are not stored"
        );
    }
    let mut plans: Vec<PlanRecord> = serde_json::from_value(v["history"].clone())
        .context("the router's plan history is not a list of plan records")?;
    for p in &mut plans {
        p.at_s = (p.at_s - offset_s).max(0.0);
    }
    Ok(plans)
}

/// Where a study's `cacheroute route` gets its plan: its own control loop (with the warm
/// start's initial plan, if any), or etcd, shared with the step's other replicas.
pub(super) enum PlanSource {
    Own(Option<RouterWarmStart>),
    /// etcd's client URL, the prefix the replicas share and this replica's id.
    Etcd {
        url: String,
        prefix: String,
        replica_id: String,
    },
}

/// Write the router's config into `dir` (with the warm start's initial plan for cacheroute, or
/// the etcd it shares its plan through) and start the router in front of `urls`.
pub(super) fn start_router(
    spec: &Spec,
    plan: &RunPlan,
    block: u32,
    // `kv_events`: the engines publish their KV-cache events at port + this offset.
    (scale, admin_token, kv_events): (TimeScale, &str, Option<u16>),
    source: PlanSource,
    urls: &[String],
    dir: &std::path::Path,
) -> Result<ChildGuard> {
    let StudyPolicy::Ours(ours) = &plan.policy else {
        bail!(
            "{}: an external router is not `cacheroute route`",
            plan.key.policy
        );
    };
    let cfg_path = dir.join("router.yaml");
    let mut cfg = router_config(spec, ours, plan.key.seed, block, scale, urls)?;
    cfg.admin_token = Some(admin_token.to_string());
    // The engines publish their KV-cache events: the router follows them (docs/kv-events.md).
    cfg.kv_events_port_offset = kv_events;
    match (ours, source) {
        (crate::policy::PolicySpec::Cacheroute(c), PlanSource::Own(Some(w))) => {
            cfg.initial_plan = Some(write_initial_plan(spec, plan, c, block, &w, dir)?);
        }
        (
            _,
            PlanSource::Etcd {
                url,
                prefix,
                replica_id,
            },
        ) => {
            cfg.etcd = Some(url);
            cfg.etcd_prefix = Some(prefix);
            cfg.replica_id = Some(replica_id);
        }
        _ => {}
    }
    std::fs::write(&cfg_path, yaml_serde::to_string(&cfg)?)?;
    spawn_listening(
        "router",
        &[
            "route".into(),
            "--config".into(),
            cfg_path.display().to_string(),
        ],
        START_TIMEOUT,
    )
}

/// The study's router configuration (what `cacheroute route --config` reads), the initial plan
/// aside: the policy as the simulated study resolves it, the engines' time scale, and the
/// fleet's engine model with the spec's knobs where the model knows the fleet, so that the
/// router's controller self-calibrates as the simulated study's does, in the model's time.
fn router_config(
    spec: &Spec,
    ours: &crate::policy::PolicySpec,
    seed: u64,
    block: u32,
    scale: TimeScale,
    urls: &[String],
) -> Result<RouterSettings> {
    let engine = fleet_engine(spec, block).ok();
    Ok(RouterSettings {
        listen: Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0))),
        backends: Some(urls.to_vec()),
        policy: Some(PolicySetting::spec(&router_policy(ours, engine.as_ref()))?),
        block_tokens: Some(block),
        seed: Some(seed),
        health_interval_ms: Some(500),
        first_byte_timeout_s: Some(600.0),
        time_scale: Some(scale),
        engine: engine.is_some().then(|| spec.fleet.engine_spec()),
        engine_knobs: engine.is_some().then(|| spec.fleet.knobs.to_overrides()),
        ..Default::default()
    })
}

/// The fleet's engine model (the spec's engine with its knobs) at the study's block size, as
/// the simulated study builds it.
fn fleet_engine(spec: &Spec, block: u32) -> Result<crate::engine::EngineConfig> {
    Ok(crate::engine::engine_config(
        &spec.fleet.engine_spec(),
        block,
        &spec.fleet.knobs.to_overrides(),
    )?)
}

/// The policy the study's router runs: the engine-dependent parameters left at 0 (CacheRoute's
/// conversation memory, Preble's prefill profile) set from the fleet's engine model, exactly
/// as the simulated study sets them; unchanged where the engine model has no entry for the
/// fleet (the router then keeps its own defaults).
fn router_policy(
    ours: &crate::policy::PolicySpec,
    engine: Option<&crate::engine::EngineConfig>,
) -> crate::policy::PolicySpec {
    match engine {
        Some(engine) => crate::policy::calibrate::resolve_policy(ours, engine),
        None => ours.clone(),
    }
}

/// Plan the warm start `w` as the simulator does, write it to `dir/initial-plan.json` and
/// return the path for the router config.
fn write_initial_plan(
    spec: &Spec,
    plan: &RunPlan,
    c: &crate::policy::cacheroute::CacheRouteConfig,
    block: u32,
    w: &RouterWarmStart,
    dir: &std::path::Path,
) -> Result<std::path::PathBuf> {
    let engine = fleet_engine(spec, block)?;
    let pc = crate::policy::calibrate::planner_for(
        c,
        &engine,
        plan.replicas,
        w.mean_prompt_tokens,
        w.mean_output_tokens,
    );
    let keys = crate::plan::export::key_loads(&w.rates);
    let p = crate::plan::build(&pc, &keys, None)?;
    let path = dir.join("initial-plan.json");
    std::fs::write(
        &path,
        serde_json::to_vec(&crate::plan::export::plan_json(&p, &w.rates, &pc))?,
    )?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_study_s_router_runs_the_policy_the_simulated_study_runs() {
        use crate::policy::PolicySpec;
        let spec = |fleet: &str| {
            Spec::parse(
                &format!(
                    "name: t\nbackend: local\nfleet: {fleet}\n\
                     policies: [ {{policy: cacheroute}}, {{policy: preble}}, {{policy: cacheroute, memory_size: 777}} ]\n\
                     ladder: [4]\nseeds: 1\nslos: [ {{metric: e2e, p99_s: 2}} ]\n"
                ),
                "t.yaml",
            )
            .unwrap()
        };
        let ours = |s: &Spec, i: usize| match &s.policies[i] {
            StudyPolicy::Ours(p) => p.clone(),
            StudyPolicy::External(_) => unreachable!(),
        };
        // The policy as router_config gives it, the fleet's engine model built from the spec.
        let policy =
            |s: &Spec, i: usize| router_policy(&ours(s, i), fleet_engine(s, 64).ok().as_ref());
        // peers-local's fleet: 6 GB of KV per replica, not an H100's whole memory.
        let s = spec("{ engine: emulator, model: qwen2.5-32b, gpu: h100, precision: fp8, tp: 1, replicas: 4, knobs: { kv_cache_bytes: 6.0e9 } }");
        let engine = fleet_engine(&s, 64).unwrap();
        let blocks = 2 * engine.kv_capacity_tokens() / engine.knobs().hash_block_tokens as u64;
        assert!((1_000..100_000).contains(&blocks), "{blocks}");
        match policy(&s, 0) {
            PolicySpec::Cacheroute(c) => assert_eq!(c.memory_size, blocks),
            p => panic!("{p:?}"),
        }
        match policy(&s, 1) {
            PolicySpec::Preble(c) => {
                assert!(c.prefill_b_s_per_token > 0.0 && c.tpot_s > 0.0, "{c:?}")
            }
            p => panic!("{p:?}"),
        }
        // A size the spec gives is kept.
        match policy(&s, 2) {
            PolicySpec::Cacheroute(c) => assert_eq!(c.memory_size, 777),
            p => panic!("{p:?}"),
        }
        // Without the knob the H100's own KV space (larger) sizes it: the knob reaches the
        // policy.
        let whole = spec("{ engine: emulator, model: qwen2.5-32b, gpu: h100, precision: fp8, tp: 1, replicas: 4 }");
        match policy(&whole, 0) {
            PolicySpec::Cacheroute(c) => {
                assert!(c.memory_size > blocks, "{} {blocks}", c.memory_size)
            }
            p => panic!("{p:?}"),
        }
    }

    #[test]
    fn the_study_s_router_keeps_the_model_s_time_and_the_fleet_s_engine_model() {
        let spec = |fleet: &str| {
            Spec::parse(
                &format!(
                    "name: t\nbackend: local\nlocal: {{ time_scale: 8 }}\nfleet: {fleet}\n\
                     policies: [ {{policy: cacheroute}} ]\nplanner: {{ q_cap: 4, interval_s: 10 }}\n\
                     ladder: [4]\nseeds: 1\nslos: [ {{metric: e2e, p99_s: 2}} ]\n"
                ),
                "t.yaml",
            )
            .unwrap()
        };
        let s = spec("{ engine: emulator, model: qwen2.5-32b, gpu: h100, precision: fp8, tp: 1, replicas: 4, knobs: { kv_cache_bytes: 6.0e9 } }");
        let run = &s.expand()[0];
        let StudyPolicy::Ours(ours) = &run.policy else {
            unreachable!()
        };
        let urls = vec!["http://127.0.0.1:1".to_string()];
        let scale = s.local.as_ref().unwrap().time_scale;
        let settings = router_config(&s, ours, 3, 64, scale, &urls).unwrap();
        // What `cacheroute route --config` reads: the same settings.
        let written = yaml_serde::to_string(&settings).unwrap();
        let read: RouterSettings = yaml_serde::from_str(&written).unwrap();
        assert_eq!(read, settings, "{written}");
        let cfg = serde_json::to_value(&settings).unwrap();
        // The policy's interval and q_cap stay in the model's time; the router is told the scale.
        assert_eq!(cfg["time_scale"], 8.0, "{cfg}");
        assert_eq!(cfg["policy"]["interval_s"], 10.0, "{cfg}");
        assert_eq!(cfg["policy"]["q_cap"], 4.0, "{cfg}");
        // The fleet's engine model with the spec's knobs: the router self-calibrates through it.
        assert_eq!(cfg["engine"], s.fleet.engine_spec(), "{cfg}");
        assert_eq!(cfg["engine_knobs"]["kv_cache_bytes"], 6.0e9, "{cfg}");
        let knobs: crate::engine::KnobOverrides =
            serde_json::from_value(cfg["engine_knobs"].clone()).unwrap();
        assert_eq!(knobs, s.fleet.knobs.to_overrides());
    }
}
