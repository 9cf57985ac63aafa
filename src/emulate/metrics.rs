//! `/metrics` in Prometheus text format, in vLLM's dialect or SGLang's.
//!
//! vLLM (V1): metric names, labels
//! (`engine="0"`, `model_name="…"`), `_total` counters with their `_created` samples, gauges
//! and histograms, as `prometheus_client` writes them for vLLM. Token counters follow vLLM's
//! definitions: `vllm:prefix_cache_queries_total` += prompt tokens looked up at every
//! admission, `vllm:prefix_cache_hits_total` += tokens found (the engine model's
//! `cache_query_tokens` / `cache_hit_tokens`).
//!
//! SGLang: names, types and labels of `python/sglang/srt/metrics/collector.py`, as its
//! multiprocess Prometheus collector serves them (`--enable-metrics` runs the collectors in
//! several processes): no `_created` samples, `# HELP … Multiprocess metric`, label names
//! sorted, `le` last. Request counters (`TokenizerMetricsCollector`, label `model_name`) have no
//! series until a request finished; `sglang:cached_tokens_total` gets its
//! `cache_source="device"` series only once a finished request had cached tokens (> 0).
//! Scheduler gauges carry `engine_type`, `model_name`, `moe_ep_rank`, `pp_rank`, `tp_rank`.

use crate::telemetry::engine_api::EngineApi;

use std::fmt::Write;

use crate::engine::{EngineConfig, EngineCounters, RequestStats};

/// vLLM's `time_to_first_token_seconds` buckets.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's request-latency buckets (`e2e_request_latency_seconds`).
const LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// SGLang's `time_to_first_token_seconds` buckets (`TokenizerMetricsCollector`).
const SGLANG_TTFT_BUCKETS: &[f64] = &[
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0,
    400.0,
];
/// SGLang's `e2e_request_latency_seconds` buckets.
const SGLANG_E2E_BUCKETS: &[f64] = &[
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0,
    400.0, 600.0, 1200.0, 1800.0, 2400.0,
];

/// A Prometheus histogram (per-bucket counts, cumulated when rendered).
#[derive(Debug, Clone)]
pub(crate) struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    /// Each bucket's `le` (as Prometheus text, `+Inf` last) and cumulative count.
    fn cumulative(&self) -> impl Iterator<Item = (String, u64)> + '_ {
        self.counts.iter().enumerate().scan(0, |cum, (i, c)| {
            *cum += c;
            let le = self.bounds.get(i).map_or("+Inf".to_string(), |&b| num(b));
            Some((le, *cum))
        })
    }

    pub(crate) fn observe(&mut self, v: f64) {
        let i = self.bounds.partition_point(|&b| b < v);
        self.counts[i] += 1;
        self.sum += v;
        self.count += 1;
    }
}

/// Everything `/metrics` shows that changes; written by the engine task.
#[derive(Debug, Clone)]
pub(crate) struct MetricsState {
    pub counters: EngineCounters,
    pub running: usize,
    pub waiting: usize,
    pub kv_usage: f64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub cached_prompt_tokens: u64,
    /// Prompt tokens of finished requests (SGLang counts at the finish).
    pub finished_prompt_tokens: u64,
    pub success: u64,
    pub ttft: Histogram,
    pub e2e: Histogram,
}

impl Default for MetricsState {
    fn default() -> Self {
        MetricsState::for_api(EngineApi::Vllm)
    }
}

impl MetricsState {
    /// Empty state with the engine's histogram buckets.
    pub(crate) fn for_api(api: EngineApi) -> Self {
        let (ttft, e2e) = match api {
            EngineApi::Vllm => (TTFT_BUCKETS, LATENCY_BUCKETS),
            EngineApi::Sglang => (SGLANG_TTFT_BUCKETS, SGLANG_E2E_BUCKETS),
        };
        MetricsState {
            counters: EngineCounters::default(),
            running: 0,
            waiting: 0,
            kv_usage: 0.0,
            prompt_tokens: 0,
            generation_tokens: 0,
            cached_prompt_tokens: 0,
            finished_prompt_tokens: 0,
            success: 0,
            ttft: Histogram::new(ttft),
            e2e: Histogram::new(e2e),
        }
    }
}

impl MetricsState {
    pub(crate) fn set_engine(
        &mut self,
        c: EngineCounters,
        running: usize,
        waiting: usize,
        kv: f64,
    ) {
        self.counters = c;
        self.running = running;
        self.waiting = waiting;
        self.kv_usage = kv;
    }

    /// A first token, `ttft_s` real seconds after the request arrived.
    pub(crate) fn observe_first_token(&mut self, prompt_tokens: u32, ttft_s: f64) {
        self.prompt_tokens += prompt_tokens as u64;
        self.ttft.observe(ttft_s);
    }

    /// A finished request, `e2e_s` real seconds after it arrived.
    pub(crate) fn observe_finished(&mut self, s: &RequestStats, e2e_s: f64) {
        self.generation_tokens += s.output_tokens as u64;
        self.cached_prompt_tokens += s.cached_tokens as u64;
        self.finished_prompt_tokens += s.prompt_tokens as u64;
        self.success += 1;
        self.e2e.observe(e2e_s);
    }
}

/// What `/metrics` shows that never changes.
#[derive(Debug, Clone)]
pub(crate) struct MetricsInfo {
    /// `engine="0",model_name="…"` (escaped).
    labels: String,
    created: f64,
    cache_config_labels: String,
    /// The model name, escaped for a label value.
    model: String,
    /// KV capacity in tokens and in blocks (pages), and the block (page) size.
    capacity_tokens: u64,
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl MetricsInfo {
    pub(crate) fn new(model_name: &str, cfg: &EngineConfig) -> MetricsInfo {
        let created = crate::unix_now_s();
        let spec = cfg.spec();
        let cache_dtype = if spec.kv == spec.weights {
            "auto"
        } else {
            spec.kv.name()
        };
        let k = cfg.knobs();
        let cache_config_labels = format!(
            "block_size=\"{}\",cache_dtype=\"{}\",enable_prefix_caching=\"True\",engine=\"0\",\
             gpu_memory_utilization=\"{}\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{}\"",
            k.block_size,
            cache_dtype,
            k.gpu_memory_utilization,
            cfg.kv_capacity_blocks()
        );
        MetricsInfo {
            labels: format!("engine=\"0\",model_name=\"{}\"", escape(model_name)),
            created,
            cache_config_labels,
            model: escape(model_name),
            capacity_tokens: cfg.kv_capacity_tokens(),
        }
    }
}

/// A float as Prometheus text (integers with `.0`, like Python).
fn num(v: f64) -> String {
    if v.is_finite() && v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.1}")
    } else if v.is_nan() {
        "NaN".to_string()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.to_string()
    } else {
        format!("{v}")
    }
}

struct Out<'a> {
    s: String,
    info: &'a MetricsInfo,
}

impl Out<'_> {
    fn header(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.s, "# HELP {name} {help}");
        let _ = writeln!(self.s, "# TYPE {name} {kind}");
    }

    fn gauge(&mut self, name: &str, help: &str, v: f64) {
        self.header(name, "gauge", help);
        let _ = writeln!(self.s, "{name}{{{}}} {}", self.info.labels, num(v));
    }

    /// `base_total` and `base_created`, as prometheus_client writes a counter.
    fn counter(&mut self, base: &str, help: &str, extra: &str, v: u64) {
        let total = format!("{base}_total");
        self.header(&total, "counter", help);
        let labels = format!("{}{extra}", self.info.labels);
        let _ = writeln!(self.s, "{total}{{{labels}}} {}", num(v as f64));
        let _ = writeln!(
            self.s,
            "{base}_created{{{labels}}} {}",
            num(self.info.created)
        );
    }

    fn histogram(&mut self, name: &str, help: &str, h: &Histogram) {
        self.header(name, "histogram", help);
        let l = &self.info.labels;
        for (le, cum) in h.cumulative() {
            let _ = writeln!(
                self.s,
                "{name}_bucket{{{l},le=\"{le}\"}} {}",
                num(cum as f64)
            );
        }
        let _ = writeln!(self.s, "{name}_count{{{l}}} {}", num(h.count as f64));
        let _ = writeln!(self.s, "{name}_sum{{{l}}} {}", num(h.sum));
        let _ = writeln!(self.s, "{name}_created{{{l}}} {}", num(self.info.created));
    }
}

/// The `/metrics` body.
pub(crate) fn render(info: &MetricsInfo, m: &MetricsState) -> String {
    let mut o = Out {
        s: String::with_capacity(8192),
        info,
    };
    o.gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        m.running as f64,
    );
    o.gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        m.waiting as f64,
    );
    o.gauge(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        m.kv_usage,
    );
    o.counter(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        "",
        m.counters.cache_query_tokens,
    );
    o.counter(
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        "",
        m.counters.cache_hit_tokens,
    );
    o.counter(
        "vllm:num_preemptions",
        "Cumulative number of preemption from the engine.",
        "",
        m.counters.preemptions,
    );
    o.counter(
        "vllm:prompt_tokens",
        "Number of prefill tokens processed.",
        "",
        m.prompt_tokens,
    );
    o.counter(
        "vllm:prompt_tokens_cached",
        "Number of cached prompt tokens (local prefix cache hits at first admission).",
        "",
        m.cached_prompt_tokens,
    );
    o.counter(
        "vllm:generation_tokens",
        "Number of generation tokens processed.",
        "",
        m.generation_tokens,
    );
    o.counter(
        "vllm:request_success",
        "Count of successfully processed requests.",
        ",finished_reason=\"length\"",
        m.success,
    );
    o.histogram(
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        &m.ttft,
    );
    o.histogram(
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        &m.e2e,
    );
    o.header(
        "vllm:cache_config_info",
        "gauge",
        "Information of the LLMEngine CacheConfig",
    );
    let _ = writeln!(
        o.s,
        "vllm:cache_config_info{{{}}} 1.0",
        info.cache_config_labels
    );
    o.s
}

/// Samples written by SGLang's multiprocess collector: `# HELP name Multiprocess metric`,
/// `# TYPE`, then the samples, labels given already sorted.
struct Mp {
    s: String,
}

impl Mp {
    fn family(&mut self, name: &str, kind: &str) {
        let _ = writeln!(self.s, "# HELP {name} Multiprocess metric");
        let _ = writeln!(self.s, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &str, v: f64) {
        let _ = writeln!(self.s, "{name}{{{labels}}} {}", num(v));
    }

    fn histogram(&mut self, name: &str, labels: &str, h: &Histogram) {
        self.family(name, "histogram");
        for (le, cum) in h.cumulative() {
            self.sample(
                &format!("{name}_bucket"),
                &format!("{labels},le=\"{le}\""),
                cum as f64,
            );
        }
        self.sample(&format!("{name}_count"), labels, h.count as f64);
        self.sample(&format!("{name}_sum"), labels, h.sum);
    }
}

/// The `/metrics` body in SGLang's dialect (see the module comment for what is taken from
/// where).
pub(crate) fn render_sglang(info: &MetricsInfo, m: &MetricsState) -> String {
    let mut o = Mp {
        s: String::with_capacity(4096),
    };
    let model = &info.model;
    // SchedulerMetricsCollector: gauges, set from the scheduler's stats.
    let sched = format!(
        "engine_type=\"unified\",model_name=\"{model}\",moe_ep_rank=\"0\",pp_rank=\"0\",tp_rank=\"0\""
    );
    let used = (m.kv_usage * info.capacity_tokens as f64).round();
    let hit_rate = if m.counters.cache_query_tokens > 0 {
        m.counters.cache_hit_tokens as f64 / m.counters.cache_query_tokens as f64
    } else {
        0.0
    };
    for (name, v) in [
        ("sglang:num_running_reqs", m.running as f64),
        ("sglang:num_queue_reqs", m.waiting as f64),
        ("sglang:num_used_tokens", used),
        ("sglang:token_usage", m.kv_usage),
        ("sglang:cache_hit_rate", hit_rate),
        ("sglang:max_total_num_tokens", info.capacity_tokens as f64),
    ] {
        o.family(name, "gauge");
        o.sample(name, &sched, v);
    }
    // TokenizerMetricsCollector: nothing until the first request finished.
    if m.success == 0 {
        return o.s;
    }
    let req = format!("model_name=\"{model}\"");
    for (name, v) in [
        ("sglang:prompt_tokens_total", m.finished_prompt_tokens),
        ("sglang:generation_tokens_total", m.generation_tokens),
        ("sglang:num_requests_total", m.success),
    ] {
        o.family(name, "counter");
        o.sample(name, &req, v as f64);
    }
    if m.cached_prompt_tokens > 0 {
        // The radix cache on the device is the only source the emulator has.
        o.family("sglang:cached_tokens_total", "counter");
        o.sample(
            "sglang:cached_tokens_total",
            &format!("cache_source=\"device\",model_name=\"{model}\""),
            m.cached_prompt_tokens as f64,
        );
    }
    o.histogram("sglang:time_to_first_token_seconds", &req, &m.ttft);
    o.histogram("sglang:e2e_request_latency_seconds", &req, &m.e2e);
    o.s
}
