//! A Prometheus text-format (0.0.4, and the OpenMetrics subset engines emit) parser, enough for
//! vLLM's and SGLang's `/metrics`: metric names with colons (`vllm:prefix_cache_hits_total`),
//! labels with escaped quotes, `_total`/`_created`/`_bucket` series, `# HELP`/`# TYPE` comments,
//! `NaN`/`+Inf`, optional timestamps. Pure.

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    /// The value of label `k`.
    pub fn label(&self, k: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(a, _)| a == k)
            .map(|(_, v)| v.as_str())
    }
}

/// A line that could not be parsed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("metrics line {line}: {why}: `{text}`")]
pub struct ParseError {
    pub line: usize,
    pub why: &'static str,
    pub text: String,
}

fn parse_value(s: &str) -> Option<f64> {
    match s {
        "NaN" => Some(f64::NAN),
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        _ => s.parse().ok(),
    }
}

/// Parse a whole exposition. Comments and blank lines are skipped.
pub fn parse(text: &str) -> Result<Vec<Sample>, ParseError> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let err = |why| ParseError {
            line: i + 1,
            why,
            text: raw.to_string(),
        };
        let name_end = line
            .find(|c: char| c == '{' || c.is_ascii_whitespace())
            .ok_or_else(|| err("no value"))?;
        let name = &line[..name_end];
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
        {
            return Err(err("bad metric name"));
        }
        let mut rest = &line[name_end..];
        let mut labels = Vec::new();
        if rest.starts_with('{') {
            rest = &rest[1..];
            loop {
                rest = rest.trim_start_matches([' ', ',']);
                if let Some(r) = rest.strip_prefix('}') {
                    rest = r;
                    break;
                }
                let eq = rest.find('=').ok_or_else(|| err("label without `=`"))?;
                let key = rest[..eq].trim().to_string();
                rest = rest[eq + 1..].trim_start();
                let body = rest
                    .strip_prefix('"')
                    .ok_or_else(|| err("label value not quoted"))?;
                let mut val = String::new();
                let mut chars = body.char_indices();
                let mut end = None;
                while let Some((j, c)) = chars.next() {
                    match c {
                        '\\' => match chars.next() {
                            Some((_, 'n')) => val.push('\n'),
                            Some((_, x)) => val.push(x),
                            None => return Err(err("unterminated escape")),
                        },
                        '"' => {
                            end = Some(j);
                            break;
                        }
                        c => val.push(c),
                    }
                }
                let end = end.ok_or_else(|| err("unterminated label value"))?;
                rest = &body[end + 1..];
                labels.push((key, val));
            }
        }
        let mut parts = rest.split_ascii_whitespace();
        let value = parts
            .next()
            .and_then(parse_value)
            .ok_or_else(|| err("bad value"))?;
        out.push(Sample {
            name: name.to_string(),
            labels,
            value,
        });
    }
    Ok(out)
}

/// Sum of all samples named `name` (over label sets), or None when absent.
pub fn sum(samples: &[Sample], name: &str) -> Option<f64> {
    let mut found = false;
    let mut s = 0.0;
    for x in samples.iter().filter(|x| x.name == name) {
        found = true;
        s += x.value;
    }
    found.then_some(s)
}

/// The served-hit counters of an engine: (hit tokens, queried tokens), by vLLM's names or
/// SGLang's.
pub fn cache_counters(samples: &[Sample]) -> Option<(f64, f64)> {
    if let (Some(h), Some(q)) = (
        sum(samples, "vllm:prefix_cache_hits_total"),
        sum(samples, "vllm:prefix_cache_queries_total"),
    ) {
        return Some((h, q));
    }
    if let (Some(h), Some(q)) = (
        sum(samples, "sglang:cached_tokens_total"),
        sum(samples, "sglang:prompt_tokens_total"),
    ) {
        return Some((h, q));
    }
    None
}

/// Requests an engine has finished, by vLLM's name (`vllm:request_success_total`, summed over
/// finish reasons) or SGLang's (`sglang:num_requests_total`).
pub fn request_count(samples: &[Sample]) -> Option<f64> {
    sum(samples, "vllm:request_success_total").or_else(|| sum(samples, "sglang:num_requests_total"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM_SHAPED: &str = r#"# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny-llama"} 2000.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="tiny-llama"} 1.764484e+09
vllm:prefix_cache_hits_total{engine="0",model_name="tiny-llama"} 896.0
vllm:num_requests_running{engine="0",model_name="tiny-llama"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="tiny-llama"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny-llama"} 2.0
vllm:cache_config_info{block_size="128",cache_dtype="auto",num_gpu_blocks="8192"} 1.0
weird_label{path="a \"quoted\" \\ value",x=""} NaN 1712345678000
"#;

    #[test]
    fn parses_vllm_shaped_exposition() {
        let s = parse(VLLM_SHAPED).unwrap();
        assert_eq!(s.len(), 8);
        assert_eq!(s[0].name, "vllm:prefix_cache_queries_total");
        assert_eq!(s[0].label("model_name"), Some("tiny-llama"));
        assert_eq!(cache_counters(&s), Some((896.0, 2000.0)));
        assert_eq!(s[5].label("le"), Some("+Inf"));
        assert_eq!(s[6].label("num_gpu_blocks"), Some("8192"));
        assert_eq!(s[7].label("path"), Some("a \"quoted\" \\ value"));
        assert!(s[7].value.is_nan());
        assert!((s[1].value - 1.764484e9).abs() < 1.0);
    }

    /// A real vLLM 0.32.0 (CPU build) `/metrics` payload, captured after the same 1000-token
    /// prompt was sent twice to the tiny model (block 128: the second request hit 896 tokens).
    const REAL_VLLM: &str = include_str!("../../tests/data/vllm-0.32.0-metrics.txt");

    #[test]
    fn parses_a_captured_real_vllm_payload() {
        let s = parse(REAL_VLLM).expect("the real payload parses");
        // Every non-comment, non-blank line is one sample.
        let lines = REAL_VLLM
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
            .count();
        assert_eq!(s.len(), lines);
        assert_eq!(cache_counters(&s), Some((896.0, 2000.0)));
        assert_eq!(sum(&s, "vllm:prompt_tokens_cached_total"), Some(896.0));
        // `_created` companions are separate samples and never counted as the counter.
        let created = s
            .iter()
            .find(|x| x.name == "vllm:prefix_cache_hits_created")
            .expect("_created line");
        assert!(created.value > 1.7e9, "{}", created.value);
        // Labels, including ones with characters beyond identifiers.
        let info = s
            .iter()
            .find(|x| x.name == "vllm:cache_config_info")
            .expect("cache_config_info");
        assert_eq!(info.label("block_size"), Some("128"));
        assert_eq!(info.label("enable_prefix_caching"), Some("True"));
        assert_eq!(info.label("kv_cache_dtype_skip_layers"), Some("[]"));
        let running = s
            .iter()
            .find(|x| x.name == "vllm:num_requests_running")
            .expect("gauge");
        assert_eq!(running.label("model_name"), Some("cacheroute-model"));
        // Histogram buckets carry `le`, including +Inf.
        assert!(s.iter().any(|x| x.name.ends_with("_bucket")
            && x.label("le") == Some("+Inf")
            && x.name.starts_with("vllm:time_to_first_token_seconds")));
    }

    #[test]
    fn bad_lines_name_their_number() {
        let e = parse("ok 1\nbroken{a=1} 2\n").unwrap_err();
        assert_eq!(e.line, 2);
        assert!(parse("x{a=\"1\"}\n").unwrap_err().why.contains("value"));
    }
}
