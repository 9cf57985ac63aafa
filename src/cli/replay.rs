//! `cacheroute replay`: replay a trace (or a generated workload) open-loop against an
//! OpenAI-compatible endpoint and print achieved vs offered rate, schedule lag, end-to-end
//! latency (and with `--stream` TTFT, TPOT and inter-token gaps), tokens/s, served KV hit and
//! errors by kind. Without `--model` the target's first `/v1/models` id is used; a run whose
//! first `--fail-fast` requests all fail the same way stops there. A thin layer over
//! `crate::loadgen`.

use crate::loadgen::{self, Endpoint, ReplayConfig, ReplayResult};
use crate::workload::gen::Workload;
use crate::workload::trace::TraceRecord;
use anyhow::{bail, Context, Result};
use clap::ValueEnum;
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndpointArg {
    /// `/v1/completions`
    Completions,
    /// `/v1/chat/completions`
    Chat,
}

const REPLAY_EXAMPLES: &str = "\
Examples:
  # A generated workload at 20 req/s for 60 s through a router, streamed (TTFT, TPOT, ITL):
  cacheroute replay --target http://127.0.0.1:8080 --workload paper --qps 20 --duration 60 --stream

  # A recorded trace at its own timestamps against one engine, records kept, summary as JSON:
  cacheroute replay --target http://gpu-1:8000 --trace traffic.jsonl --block-tokens 16 \\
      --model meta-llama/Llama-3.1-8B-Instruct --out records.jsonl --json

  # Multi-turn sessions with live answers: each turn after the previous answer (plus a
  # 2 s think time), its prompt carrying that answer, so engines can reuse its tokens:
  cacheroute replay --target http://127.0.0.1:8080 --workload chat.yaml --qps 4 --duration 120 \\
      --sessions live --think-time-s 2

See docs/replayer.md.";

#[derive(clap::Args, Debug)]
#[command(after_help = REPLAY_EXAMPLES)]
pub struct ReplayArgs {
    /// Base URL of the endpoint, http://HOST:PORT (a trailing /v1 is accepted): the cacheroute
    /// router, vLLM, SGLang or `cacheroute emulate`.
    #[arg(long, value_name = "URL")]
    pub target: String,
    /// Trace file (JSONL; Mooncake files load as they are), replayed at its own timestamps
    /// unless --qps is given.
    #[arg(long, conflicts_with = "workload")]
    pub trace: Option<PathBuf>,
    /// Generated workload: `paper` or a generator YAML file (needs --qps).
    #[arg(long)]
    pub workload: Option<String>,
    /// Offered load, requests/s (a trace's timestamps are rescaled to this mean rate).
    #[arg(long)]
    pub qps: Option<f64>,
    /// Seconds of traffic (generated workloads; with --trace, a cut-off).
    #[arg(long, default_value_t = 60.0)]
    pub duration: f64,
    /// Seed of a generated workload (keys, arrivals, lengths); equal seeds give equal traffic.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Stream responses (SSE), measuring TTFT, TPOT and inter-token gaps (without it only
    /// end-to-end latency is measured).
    #[arg(long)]
    pub stream: bool,
    /// Outstanding requests allowed; requests due beyond it are counted as `overflow` errors.
    #[arg(long = "max-inflight", default_value_t = 4096)]
    pub max_inflight: usize,
    /// Per-request timeout in seconds (from the actual send).
    #[arg(long, default_value_t = 600.0)]
    pub timeout: f64,
    /// The OpenAI endpoint requests go to.
    #[arg(long, value_enum, default_value_t = EndpointArg::Completions)]
    pub endpoint: EndpointArg,
    /// The `model` field of each request (vLLM: the served model name) [default: the first
    /// id the target lists at /v1/models].
    #[arg(long)]
    pub model: Option<String>,
    /// Stop when the first N requests to end all failed the same way (same status), with that
    /// error; 0 never stops.
    #[arg(long, value_name = "N", default_value_t = 20)]
    pub fail_fast: usize,
    /// Header that carries each request's routing key.
    #[arg(long = "key-header", default_value = "x-cacheroute-key")]
    pub key_header: String,
    /// Tokens per trace block for the prompt text (default: the generator's, or 512 for a
    /// trace file, Mooncake's block size).
    #[arg(long = "block-tokens", alias = "block-size")]
    pub block_size: Option<u32>,
    /// Do not send `ignore_eos: true` (engines may then stop before `output_length`).
    #[arg(long = "no-ignore-eos")]
    pub no_ignore_eos: bool,
    /// How the turns of a trace `session` are sent: `trace` (each at its own time, its prompt
    /// synthesised from the trace) or `live` (in turn order, each after the previous answer,
    /// its prompt = the previous prompt + the actual answer + the new user message).
    #[arg(long, value_name = "MODE", default_value = "trace", value_parser = parse_sessions)]
    pub sessions: loadgen::Sessions,
    /// With --sessions live: the pause between an answer and the next turn: `trace` (keep the
    /// trace's gap between the turns; a slower answer makes the turn late), SECONDS after the
    /// answer, or exp:MEAN (exponential, mean MEAN seconds).
    #[arg(long = "think-time-s", value_name = "trace|SECONDS|exp:MEAN", value_parser = parse_think)]
    pub think_time_s: Option<loadgen::ThinkTime>,
    /// Print the summary as JSON.
    #[arg(long)]
    pub json: bool,
    /// Write one JSON record per request to this file (JSONL).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

fn parse_sessions(s: &str) -> Result<loadgen::Sessions, String> {
    s.parse()
}

fn parse_think(s: &str) -> Result<loadgen::ThinkTime, String> {
    s.parse()
}

/// A schedule of either source, sendable to the dispatcher thread.
type Schedule = Box<dyn Iterator<Item = (f64, TraceRecord)> + Send>;

pub fn run(a: ReplayArgs) -> Result<()> {
    if let Some(q) = a.qps {
        if !(q.is_finite() && q > 0.0) {
            bail!("--qps must be a number > 0");
        }
    }
    if !(a.duration.is_finite() && a.duration > 0.0) {
        bail!("--duration must be > 0 seconds");
    }
    if !(a.timeout.is_finite() && a.timeout > 0.0) {
        bail!("--timeout must be > 0 seconds");
    }
    let mut cfg = ReplayConfig::new(a.target.clone());
    cfg.endpoint = match a.endpoint {
        EndpointArg::Completions => Endpoint::Completions,
        EndpointArg::Chat => Endpoint::Chat,
    };
    cfg.stream = a.stream;
    cfg.fail_fast = a.fail_fast;
    cfg.key_header = a.key_header.clone();
    cfg.max_inflight = a.max_inflight;
    cfg.timeout = Duration::from_secs_f64(a.timeout);
    cfg.ignore_eos = !a.no_ignore_eos;
    cfg.sessions = a.sessions;
    if let Some(t) = a.think_time_s {
        if a.sessions != loadgen::Sessions::Live {
            bail!("--think-time-s applies to live sessions only; add --sessions live");
        }
        cfg.think_time = t;
    }

    let (schedule, n, source): (Schedule, Option<usize>, String) = match (&a.trace, &a.workload) {
        (Some(p), _) => {
            let (v, cut) = super::load_trace_file(p, a.qps, a.duration)?;
            cfg.block_tokens = a.block_size.unwrap_or(512);
            // The rate window is --duration when the trace was cut there, else its span.
            cfg.duration_s = cut.then_some(a.duration);
            let n = v.len();
            (
                Box::new(loadgen::schedule(v)),
                Some(n),
                format!("trace {}", p.display()),
            )
        }
        (None, None) => {
            bail!("nothing to replay; pass --trace FILE or --workload paper|FILE.yaml (with --qps)")
        }
        (None, Some(w)) => {
            let gcfg = super::workload_config(Some(w.as_str()), a.block_size)?;
            let qps = a.qps.context("--qps is needed with a generated workload")?;
            super::check_run_size(qps, a.duration)?;
            cfg.block_tokens = gcfg.prefix.block_size;
            cfg.duration_s = Some(a.duration);
            let wl = Workload::load(&gcfg)?;
            let gen = wl.generate(qps, a.duration, a.seed)?;
            (
                Box::new(loadgen::schedule(gen)),
                None,
                format!("workload {w} at {qps} req/s"),
            )
        }
    };
    let problems = cfg.validate();
    if !problems.is_empty() {
        bail!("{}", problems.join("; "));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("cacheroute-replay")
        .build()
        .context("starting the tokio runtime")?;
    cfg.model = match &a.model {
        Some(m) => m.clone(),
        None => {
            let m = rt.block_on(loadgen::first_model(&cfg))?;
            if !a.json {
                tracing::info!(
                    "model {m} (the first at {}; pass --model to choose)",
                    cfg.models_url()?
                );
            }
            m
        }
    };
    if !a.json {
        tracing::info!(
            "replaying {source}{} open-loop to {} ({}{}, in-flight cap{})",
            n.map(|n| format!(" ({n} requests)")).unwrap_or_default(),
            cfg.url()?,
            if cfg.stream { "stream" } else { "no stream" },
            if cfg.ignore_eos { ", ignore_eos" } else { "" },
            match cfg.sessions {
                loadgen::Sessions::Trace => format!(" {}", cfg.max_inflight),
                loadgen::Sessions::Live => format!(
                    " {}; live sessions, think time {}",
                    cfg.max_inflight,
                    cfg.think_time.label()
                ),
            }
        );
    }
    let quiet = a.json;
    let res = rt.block_on(loadgen::replay_until(&cfg, schedule, async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            if !quiet {
                tracing::warn!("interrupted: no more requests are sent; waiting for those in flight (Ctrl-C again to abort)");
            }
            tokio::spawn(async {
                if tokio::signal::ctrl_c().await.is_ok() {
                    std::process::exit(130);
                }
            });
        } else {
            std::future::pending::<()>().await
        }
    }))?;
    if res.interrupted && !a.json {
        tracing::warn!(
            "stopped early after {} requests; figures cover the first {:.1} s",
            res.records.len(),
            res.summary.duration_s
        );
    }
    if let Some(p) = &a.out {
        write_records(p, &res)?;
    }
    print_summary(&res, a.json, a.out.as_deref())?;
    match res.aborted {
        Some(why) => bail!("{why}"),
        None => Ok(()),
    }
}

fn write_records(path: &std::path::Path, res: &ReplayResult) -> Result<()> {
    let mut buf = Vec::with_capacity(res.records.len() * 256);
    for r in &res.records {
        serde_json::to_writer(&mut buf, r)?;
        buf.push(b'\n');
    }
    super::write_atomic(path, &buf)
}

fn ms(s: f64) -> String {
    if s.is_nan() {
        "-".into()
    } else {
        format!("{:.3} ms", s * 1e3)
    }
}

fn print_summary(res: &ReplayResult, json: bool, out: Option<&std::path::Path>) -> Result<()> {
    let s = &res.summary;
    if json {
        let mut v = serde_json::to_value(s)?;
        if let Some(p) = out {
            v["records_file"] = p.display().to_string().into();
        }
        v["start_unix_s"] = res.start_unix_s.into();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let mut o = std::io::stdout().lock();
    let pct = if s.offered_qps > 0.0 {
        100.0 * s.achieved_qps / s.offered_qps
    } else {
        f64::NAN
    };
    writeln!(
        o,
        "requests {}  sent {}  ok {}  errors {}  over {:.1} s (wall {:.1} s)",
        s.requests,
        s.sent,
        s.ok,
        s.error_count(),
        s.duration_s,
        s.wall_s
    )?;
    writeln!(
        o,
        "rate       offered {:.1} req/s  achieved {:.1} req/s ({pct:.2}%)",
        s.offered_qps, s.achieved_qps
    )?;
    writeln!(
        o,
        "sched lag  p50 {}  p99 {}  max {}",
        ms(s.lag_p50_s),
        ms(s.lag_p99_s),
        ms(s.lag_max_s)
    )?;
    if s.stream {
        writeln!(
            o,
            "ttft       p50 {}  p99 {}   (from the scheduled time)",
            ms(s.ttft_p50_s),
            ms(s.ttft_p99_s)
        )?;
    } else {
        writeln!(
            o,
            "ttft       -   (not measured: pass --stream; an answer not streamed arrives whole)"
        )?;
    }
    writeln!(
        o,
        "e2e        p50 {}  p99 {}   (from the scheduled time)",
        ms(s.e2e_p50_s),
        ms(s.e2e_p99_s)
    )?;
    if s.stream {
        writeln!(
            o,
            "tpot       p50 {}  p99 {}   (per request: (end − first token) / (output tokens − 1))",
            ms(s.tpot_p50_s),
            ms(s.tpot_p99_s)
        )?;
        writeln!(
            o,
            "itl        p50 {}  p99 {}   (every gap between tokens); largest gap per request p99 {}",
            ms(s.itl_p50_s),
            ms(s.itl_p99_s),
            ms(s.max_itl_p99_s)
        )?;
    }
    writeln!(
        o,
        "tokens/s   output {:.1}  prompt {:.1}   ({} output, {} prompt tokens over {:.1} s)",
        s.output_tokens_per_s, s.prompt_tokens_per_s, s.output_tokens, s.prompt_tokens, s.wall_s
    )?;
    if s.served_kv_hit.is_nan() {
        writeln!(
            o,
            "kv hit     -   (no answer reported usage.prompt_tokens_details.cached_tokens)"
        )?;
    } else {
        writeln!(
            o,
            "kv hit     {:.1}% served   (cached / prompt tokens; {} of {} ok answers reported it)",
            100.0 * s.served_kv_hit,
            s.kv_hit_reported,
            s.ok
        )?;
    }
    if let Some(ss) = &s.sessions {
        writeln!(
            o,
            "sessions   {} live: turns {}  sent {}  late {} (p99 {})  abandoned {} sessions ({} turns)",
            ss.sessions,
            ss.turns,
            ss.turns_sent,
            ss.turns_late,
            ms(ss.late_p99_s),
            ss.sessions_abandoned,
            ss.turns_abandoned
        )?;
        if !ss.later_turns_kv_hit.is_nan() {
            writeln!(
                o,
                "           kv hit of turns after the first {:.1}% served",
                100.0 * ss.later_turns_kv_hit
            )?;
        }
    }
    if s.errors.is_empty() {
        writeln!(o, "errors     none")?;
    } else {
        let e: Vec<String> = s.errors.iter().map(|(k, v)| format!("{k} {v}")).collect();
        writeln!(o, "errors     {}", e.join(", "))?;
        if let Some(r) = res.records.iter().find(|r| r.error.is_some()) {
            writeln!(
                o,
                "first error (request {}): {}",
                r.record.id,
                r.error.as_deref().unwrap_or_default()
            )?;
        }
    }
    if let Some(p) = out {
        writeln!(
            o,
            "records    {} ({} lines)",
            p.display(),
            res.records.len()
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_help_examples_parse() {
        assert_eq!(
            crate::cli::route::tests::examples_parse(super::REPLAY_EXAMPLES),
            3
        );
    }
}
