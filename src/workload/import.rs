//! Importers: public traces into the trace format, and arrival-gap samples for bootstrap and
//! replay arrivals.
//!
//! - Mooncake JSONL: read as-is by [`super::trace::TraceReader`] (keys derived from the first
//!   N blocks); nothing here beyond that.
//! - Azure LLM inference CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`): arrival times and
//!   lengths are real; keys and prefixes are synthesized by the rule in [`AzureOptions`].
//! - `key,rate` CSV: see `workload::rates` (it feeds the generator's `csv` key distribution).
//!
//! Readers take `BufRead` and stream; [`load_gaps`] opens a path (the one convenience that
//! touches the file system). Randomness comes from a seed.

use super::trace::{ReaderOptions, TraceError, TraceReader, TraceRecord};
use crate::rng::{derive, mix64};
use std::io::BufRead;
use std::path::Path;

/// Errors importing; each names the line and what to do.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("reading: {0}")]
    Io(#[from] std::io::Error),
    #[error(
        "line 1: expected the Azure header `TIMESTAMP,ContextTokens,GeneratedTokens`, found `{0}`"
    )]
    AzureHeader(String),
    #[error("line {line}: {msg}; expected `YYYY-MM-DD HH:MM:SS[.fraction],<context tokens>,<generated tokens>`")]
    AzureRow { line: usize, msg: String },
    #[error(
        "line {line}: timestamp goes backwards ({msg}); the Azure CSV must be sorted by TIMESTAMP"
    )]
    AzureOrder { line: usize, msg: String },
    #[error("the file has no rows")]
    Empty,
    #[error(transparent)]
    Trace(#[from] TraceError),
}

/// One Azure row: seconds since the first row, and lengths.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AzureRow {
    pub t_s: f64,
    pub context_tokens: u32,
    pub generated_tokens: u32,
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let mp = (m as i64 + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Parse `YYYY-MM-DD HH:MM:SS[.fraction]` to seconds since the Unix epoch (UTC, no zone).
pub fn parse_azure_time(s: &str) -> Option<f64> {
    let (date, time) = s.trim().split_once([' ', 'T'])?;
    let mut dp = date.split('-');
    let y: i64 = dp.next()?.parse().ok()?;
    let mo: u32 = dp.next()?.parse().ok()?;
    let d: u32 = dp.next()?.parse().ok()?;
    if dp.next().is_some() || !(1..=12).contains(&mo) || !(1..=31).contains(&d) {
        return None;
    }
    let mut tp = time.split(':');
    let h: u32 = tp.next()?.parse().ok()?;
    let mi: u32 = tp.next()?.parse().ok()?;
    let sec: f64 = tp.next()?.parse().ok()?;
    if tp.next().is_some() || h > 23 || mi > 59 || !(0.0..61.0).contains(&sec) {
        return None;
    }
    Some(days_from_civil(y, mo, d) as f64 * 86_400.0 + h as f64 * 3600.0 + mi as f64 * 60.0 + sec)
}

/// Read an Azure LLM inference CSV, streaming, validating every row.
pub fn read_azure<R: BufRead>(reader: R) -> impl Iterator<Item = Result<AzureRow, ImportError>> {
    let mut lines = reader.lines().enumerate();
    let mut t0: Option<f64> = None;
    let mut prev = f64::NEG_INFINITY;
    let mut started = false;
    let mut done = false;
    std::iter::from_fn(move || loop {
        if done {
            return None;
        }
        let Some((i, line)) = lines.next() else {
            done = true;
            return (!started || t0.is_none()).then_some(Err(ImportError::Empty));
        };
        let lineno = i + 1;
        let line = match line {
            Ok(l) => l,
            Err(e) => {
                done = true;
                return Some(Err(e.into()));
            }
        };
        let line = line.trim().trim_start_matches('\u{feff}');
        if !started {
            started = true;
            let cols: Vec<&str> = line.split(',').map(str::trim).collect();
            if cols != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"] {
                done = true;
                return Some(Err(ImportError::AzureHeader(line.to_string())));
            }
            continue;
        }
        if line.is_empty() {
            continue;
        }
        let row = (|| {
            let f: Vec<&str> = line.split(',').map(str::trim).collect();
            if f.len() != 3 {
                return Err(format!("expected 3 columns, found {}", f.len()));
            }
            let t = parse_azure_time(f[0]).ok_or_else(|| format!("bad TIMESTAMP `{}`", f[0]))?;
            let c: u32 = f[1]
                .parse()
                .map_err(|_| format!("bad ContextTokens `{}`", f[1]))?;
            let g: u32 = f[2]
                .parse()
                .map_err(|_| format!("bad GeneratedTokens `{}`", f[2]))?;
            Ok((t, c, g))
        })();
        let (t, c, g) = match row {
            Ok(x) => x,
            Err(msg) => {
                done = true;
                return Some(Err(ImportError::AzureRow { line: lineno, msg }));
            }
        };
        if t < prev {
            done = true;
            return Some(Err(ImportError::AzureOrder {
                line: lineno,
                msg: format!("{t:.6} < {prev:.6} s"),
            }));
        }
        prev = t;
        let base = *t0.get_or_insert(t);
        return Some(Ok(AzureRow {
            t_s: t - base,
            context_tokens: c,
            generated_tokens: g,
        }));
    })
}

/// How keys and prefixes are synthesized for an Azure CSV (it has neither).
///
/// Rule: `keys` keys get lognormal(0, σ) popularity (seeded, as the generator does); each
/// request's key is drawn independently by popularity. A request's first
/// `min(ContextTokens, prefix_tokens)` tokens are its key's shared prefix (block ids derived
/// from the key), the rest is unique to the request. Arrival times and lengths are the file's.
#[derive(Debug, Clone)]
pub struct AzureOptions {
    pub keys: usize,
    pub sigma: f64,
    pub prefix_tokens: u32,
    pub block_size: u32,
    pub seed: u64,
}

impl Default for AzureOptions {
    fn default() -> Self {
        AzureOptions {
            keys: 1000,
            sigma: super::rates::PAPER_SIGMA,
            prefix_tokens: 1024,
            block_size: 16,
            seed: 1,
        }
    }
}

/// Convert Azure rows into trace records by the [`AzureOptions`] rule.
pub fn azure_records<I>(
    rows: I,
    opts: &AzureOptions,
) -> impl Iterator<Item = Result<TraceRecord, ImportError>>
where
    I: Iterator<Item = Result<AzureRow, ImportError>>,
{
    let mut rng = derive(opts.seed, "import/azure/key-rates");
    let weights = super::rates::lognormal_rates(opts.keys.max(1), opts.sigma, 1.0, &mut rng);
    let alias = crate::rng::Alias::new(&weights);
    let mut key_rng = derive(opts.seed, "import/azure/keys");
    let opts = opts.clone();
    let bs = opts.block_size.max(1);
    let mut n = 0u64;
    rows.map(move |row| {
        let row = row?;
        let k = alias.sample(&mut key_rng);
        n += 1;
        let input = row.context_tokens;
        let shared_full = input.min(opts.prefix_tokens) / bs;
        let key_base = mix64(opts.seed ^ mix64(k as u64 ^ 0xA2A2_0000_0000_0000));
        let req_base = mix64(opts.seed ^ mix64(n ^ 0x7E57_0000_0000_0000));
        let hash_ids = (0..input.div_ceil(bs) as u64)
            .map(|j| {
                let base = if j < shared_full as u64 {
                    key_base
                } else {
                    req_base
                };
                mix64(base.wrapping_add(j.wrapping_mul(0xD6E8_FEB8_6659_FD93)))
            })
            .collect();
        Ok(TraceRecord {
            timestamp_ms: (row.t_s * 1e6).round() / 1e3,
            key: super::rates::key_name(k),
            input_length: input,
            output_length: row.generated_tokens,
            hash_ids,
            session: None,
            turn: None,
        })
    })
}

/// Inter-arrival gaps (seconds) from an Azure CSV (path ends in `.csv`) or a JSONL trace.
pub fn load_gaps(path: &Path) -> Result<Vec<f64>, ImportError> {
    let f = std::io::BufReader::new(std::fs::File::open(path)?);
    let times: Vec<f64> = if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("csv"))
    {
        read_azure(f)
            .map(|r| r.map(|r| r.t_s))
            .collect::<Result<_, _>>()?
    } else {
        TraceReader::new(f, ReaderOptions::default())
            .map(|r| r.map(|r| r.timestamp_ms / 1000.0))
            .collect::<Result<_, _>>()?
    };
    Ok(super::arrivals::gaps_of(&times))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn azure_time_and_rows() {
        let a = parse_azure_time("2023-11-16 18:15:46.6805900").unwrap();
        let b = parse_azure_time("2023-11-16 18:15:50.9951690").unwrap();
        assert!((b - a - 4.314579).abs() < 1e-6);
        assert_eq!(parse_azure_time("1970-01-02 00:00:00"), Some(86_400.0));
        assert!(parse_azure_time("2023-13-01 00:00:00").is_none());
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n\
                    2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n";
        let rows: Vec<_> = read_azure(text.as_bytes())
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].t_s, 0.0);
        assert_eq!(rows[1].generated_tokens, 109);
        let recs: Vec<_> = azure_records(rows.into_iter().map(Ok), &AzureOptions::default())
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(recs[0].hash_ids.len(), 374usize.div_ceil(16));
        assert!((recs[1].timestamp_ms - 4314.579).abs() < 1e-6);
    }

    #[test]
    fn azure_errors() {
        let e = |t: &str| {
            read_azure(t.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .unwrap_err()
                .to_string()
        };
        assert!(e("").contains("no rows"));
        assert!(e("TIMESTAMP,ContextTokens,GeneratedTokens\n").contains("no rows"));
        assert!(e("a,b\n").contains("header"));
        let h = "TIMESTAMP,ContextTokens,GeneratedTokens\n";
        assert!(e(&format!("{h}2023-11-16 18:15:46,x,1\n")).contains("line 2: bad ContextTokens"));
        assert!(e(&format!(
            "{h}2023-11-16 18:15:46,1,1\n2023-11-16 18:15:45,1,1\n"
        ))
        .contains("line 3"));
    }
}
