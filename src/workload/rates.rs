//! Per-key request rates: the planner's input and the generator's key popularity.
//!
//! Distributions (lognormal, Zipf, whales), a drift step (lognormal random walk), and the
//! `key,rate[,prefix_tokens]` CSV format with strict validation. Pure: randomness is passed in.

use crate::rng::IdHasher;
use crate::rng::Rng64;
use rand::RngExt;
use rand_distr::{Distribution, LogNormal, StandardNormal};
use std::collections::{HashMap, HashSet};
use std::hash::BuildHasherDefault;
use std::io::{BufRead, Write};

/// Number of keys in the paper's flagship workload.
pub const PAPER_KEYS: usize = 128_824;
/// Lognormal σ reproducing the paper's key skew (Gini 0.756, top 4% ≈ 46%).
pub const PAPER_SIGMA: f64 = 1.648;

/// One key's measured or generated rate.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyRate {
    pub key: String,
    /// Requests per second.
    pub rate: f64,
    /// Reusable prefix size in tokens, when known (enables byte-aware admission).
    pub prefix_tokens: Option<f64>,
}

/// Errors reading a rates file; each names the line and what to do.
#[derive(Debug, thiserror::Error)]
pub enum RatesError {
    #[error(
        "rates file is empty: expected a header `key,rate[,prefix_tokens]` and at least one row"
    )]
    Empty,
    #[error("line 1: header must be `key,rate` or `key,rate,prefix_tokens`, found `{0}`")]
    BadHeader(String),
    #[error("line {line}: expected {expected} comma-separated columns, found {found}; fix or remove the row")]
    Columns {
        line: usize,
        expected: usize,
        found: usize,
    },
    #[error("line {line}: empty key; every row needs a non-empty key")]
    EmptyKey { line: usize },
    #[error("line {line}: {msg}; fix the row (a rate is requests/s, the same range for `plan`, `advise`, `rates` and `trace import`)")]
    BadRate { line: usize, msg: String },
    #[error("line {line}: prefix_tokens `{value}` is not a finite number ≥ 0")]
    BadPrefix { line: usize, value: String },
    #[error("line {line}: duplicate key `{key}` (first seen on line {first}); merge the rows")]
    Duplicate {
        line: usize,
        key: String,
        first: usize,
    },
    #[error("rates file has a header but no rows")]
    NoRows,
    #[error("reading rates: {0}")]
    Io(#[from] std::io::Error),
}

/// Read a `key,rate[,prefix_tokens]` CSV, validating every row.
pub fn read_rates_csv<R: BufRead>(reader: R) -> Result<Vec<KeyRate>, RatesError> {
    read_rates_csv_hashed(reader, crate::key_hash)
}

/// [`read_rates_csv`] with the key hash used for duplicate detection as a parameter (tests
/// pass one that collides).
fn read_rates_csv_hashed<R: BufRead>(
    reader: R,
    hash: fn(&str) -> u64,
) -> Result<Vec<KeyRate>, RatesError> {
    let mut lines = reader.lines();
    let header = match lines.next() {
        None => return Err(RatesError::Empty),
        Some(h) => h?,
    };
    let header = header.trim().trim_start_matches('\u{feff}');
    if header.is_empty() {
        return Err(RatesError::Empty);
    }
    let cols: Vec<&str> = header.split(',').map(str::trim).collect();
    let ncols = match cols.as_slice() {
        ["key", "rate"] => 2,
        ["key", "rate", "prefix_tokens"] => 3,
        _ => return Err(RatesError::BadHeader(header.to_string())),
    };
    let mut out: Vec<KeyRate> = Vec::new();
    // Duplicates are found without a copy of every key (128k small allocations freed at the
    // end left the allocator's bins full for whoever allocates next): key hash → (row, line)
    // of the first key with that hash; a different key whose hash is taken (a 64-bit
    // collision) goes to `collided`, which is scanned.
    let mut seen: HashMap<u64, (usize, usize), BuildHasherDefault<IdHasher>> = HashMap::default();
    let mut collided: Vec<(u64, usize, usize)> = Vec::new();
    for (i, line) in lines.enumerate() {
        let lineno = i + 2;
        let line = line?;
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        if fields.len() != ncols {
            return Err(RatesError::Columns {
                line: lineno,
                expected: ncols,
                found: fields.len(),
            });
        }
        let key = fields[0];
        if key.is_empty() {
            return Err(RatesError::EmptyKey { line: lineno });
        }
        let rate: f64 = fields[1].parse().map_err(|_| RatesError::BadRate {
            line: lineno,
            msg: format!("rate `{}` is not a number", fields[1]),
        })?;
        if let Some(msg) = crate::bounds::rate("rate", rate) {
            return Err(RatesError::BadRate { line: lineno, msg });
        }
        let prefix_tokens = if ncols == 3 {
            Some(
                fields[2]
                    .parse()
                    .ok()
                    .filter(|r: &f64| r.is_finite() && *r >= 0.0)
                    .ok_or_else(|| RatesError::BadPrefix {
                        line: lineno,
                        value: fields[2].to_string(),
                    })?,
            )
        } else {
            None
        };
        let h = hash(key);
        let first = match seen.get(&h) {
            None => {
                seen.insert(h, (out.len(), lineno));
                None
            }
            Some(&(row, line)) if out[row].key == key => Some(line),
            Some(_) => {
                let hit = collided
                    .iter()
                    .find(|c| c.0 == h && out[c.1].key == key)
                    .map(|c| c.2);
                if hit.is_none() {
                    collided.push((h, out.len(), lineno));
                }
                hit
            }
        };
        if let Some(first) = first {
            return Err(RatesError::Duplicate {
                line: lineno,
                key: key.to_string(),
                first,
            });
        }
        out.push(KeyRate {
            key: key.to_string(),
            rate,
            prefix_tokens,
        });
    }
    if out.is_empty() {
        return Err(RatesError::NoRows);
    }
    Ok(out)
}

/// Write rates as CSV (with `prefix_tokens` when any row has it).
pub fn write_rates_csv<W: Write>(mut w: W, rates: &[KeyRate]) -> std::io::Result<()> {
    let with_prefix = rates.iter().any(|r| r.prefix_tokens.is_some());
    if with_prefix {
        writeln!(w, "key,rate,prefix_tokens")?;
    } else {
        writeln!(w, "key,rate")?;
    }
    for r in rates {
        if with_prefix {
            writeln!(
                w,
                "{},{:.6e},{}",
                r.key,
                r.rate,
                r.prefix_tokens.unwrap_or(0.0)
            )?;
        } else {
            writeln!(w, "{},{:.6e}", r.key, r.rate)?;
        }
    }
    Ok(())
}

/// Key name for the i-th generated key (stable, sortable).
pub fn key_name(i: usize) -> String {
    format!("k{i:06}")
}

/// Rates proportional to lognormal(0, σ) draws, scaled so they sum to `total_qps`.
/// σ = 1.648 reproduces the paper's distribution (Gini 0.756, top 4% ≈ 46%).
pub fn lognormal_rates(n: usize, sigma: f64, total_qps: f64, rng: &mut Rng64) -> Vec<f64> {
    let dist = LogNormal::new(0.0, sigma.max(1e-12)).expect("valid lognormal");
    let mut v: Vec<f64> = (0..n).map(|_| dist.sample(rng)).collect();
    normalize(&mut v, total_qps);
    v
}

/// Zipf-like rates: the key of rank i (1-based) gets weight i^(-s); keys are then shuffled so
/// that key names carry no rank information.
pub fn zipf_rates(n: usize, exponent: f64, total_qps: f64, rng: &mut Rng64) -> Vec<f64> {
    let mut v: Vec<f64> = (1..=n).map(|i| (i as f64).powf(-exponent)).collect();
    // Fisher-Yates shuffle with our RNG.
    for i in (1..v.len()).rev() {
        let j = rng.random_range(0..=i);
        v.swap(i, j);
    }
    normalize(&mut v, total_qps);
    v
}

/// Turn `n_whales` keys (the first ones) into whales carrying `share` of all traffic in
/// total, scaling the others so the total is unchanged.
pub fn add_whales(rates: &mut [f64], n_whales: usize, share: f64) {
    let n_whales = n_whales.min(rates.len());
    if n_whales == 0 || !(0.0..1.0).contains(&share) {
        return;
    }
    let total: f64 = rates.iter().sum();
    let rest: f64 = rates[n_whales..].iter().sum();
    let scale = if rest > 0.0 {
        total * (1.0 - share) / rest
    } else {
        0.0
    };
    for r in rates[n_whales..].iter_mut() {
        *r *= scale;
    }
    for r in rates[..n_whales].iter_mut() {
        *r = total * share / n_whales as f64;
    }
}

/// One step of a lognormal random walk: every rate is multiplied by exp(σ·Z − σ²/2)
/// (mean-preserving), then the total is restored.
pub fn drift_step(rates: &mut [f64], sigma: f64, rng: &mut Rng64) {
    let total: f64 = rates.iter().sum();
    for r in rates.iter_mut() {
        let z: f64 = StandardNormal.sample(rng);
        *r *= (sigma * z - 0.5 * sigma * sigma).exp();
    }
    normalize(rates, total);
}

/// Scale so the values sum to `total`.
pub fn normalize(v: &mut [f64], total: f64) {
    let s: f64 = v.iter().sum();
    if s > 0.0 {
        let f = total / s;
        for x in v.iter_mut() {
            *x *= f;
        }
    }
}

/// Gini coefficient of non-negative values (0 = equal, → 1 = one holds everything).
pub fn gini(values: &[f64]) -> f64 {
    let n = values.len();
    if n == 0 {
        return 0.0;
    }
    let mut v: Vec<f64> = values.to_vec();
    v.sort_unstable_by(f64::total_cmp);
    let sum: f64 = v.iter().sum();
    if sum <= 0.0 {
        return 0.0;
    }
    let weighted: f64 = v
        .iter()
        .enumerate()
        .map(|(i, x)| (i as f64 + 1.0) * x)
        .sum();
    (2.0 * weighted) / (n as f64 * sum) - (n as f64 + 1.0) / n as f64
}

/// Share of the total carried by the top `fraction` of values (e.g. 0.04 for the top 4%).
pub fn top_share(values: &[f64], fraction: f64) -> f64 {
    let mut v: Vec<f64> = values.to_vec();
    v.sort_unstable_by(|a, b| b.total_cmp(a));
    let k = ((v.len() as f64 * fraction).ceil() as usize).clamp(1, v.len().max(1));
    let sum: f64 = v.iter().sum();
    if sum <= 0.0 {
        return 0.0;
    }
    v[..k.min(v.len())].iter().sum::<f64>() / sum
}

/// Named key rates from plain values (`k000000`, `k000001`, …).
pub fn named(rates: &[f64]) -> Vec<KeyRate> {
    rates
        .iter()
        .enumerate()
        .map(|(i, &rate)| KeyRate {
            key: key_name(i),
            rate,
            prefix_tokens: None,
        })
        .collect()
}

/// Check that keys are unique (for rates built in code rather than read from a file).
pub fn assert_unique(rates: &[KeyRate]) -> bool {
    let mut s = HashSet::with_capacity(rates.len());
    rates.iter().all(|r| s.insert(r.key.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::seeded;

    #[test]
    fn paper_lognormal_matches_paper_shape() {
        let mut rng = seeded(1);
        let r = lognormal_rates(128_824, 1.648, 100.0, &mut rng);
        let g = gini(&r);
        assert!((g - 0.756).abs() < 0.01, "gini {g}");
        let t4 = top_share(&r, 0.04);
        assert!((0.44..=0.49).contains(&t4), "top4 {t4}");
        let max = r.iter().cloned().fold(0.0, f64::max) / 100.0;
        assert!(max <= 0.003, "largest key share {max}");
    }

    #[test]
    fn csv_roundtrip_and_errors() {
        let text = "key,rate\na,1.5\nb,2\n";
        let r = read_rates_csv(text.as_bytes()).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[1].rate, 2.0);
        let mut buf = Vec::new();
        write_rates_csv(&mut buf, &r).unwrap();
        assert_eq!(read_rates_csv(&buf[..]).unwrap(), r);

        let e = |t: &str| read_rates_csv(t.as_bytes()).unwrap_err().to_string();
        assert!(e("").contains("empty"));
        assert!(e("key,rate\n").contains("no rows"));
        assert!(e("key\na\n").contains("header"));
        assert!(e("key,rate\na\n").contains("line 2"));
        assert!(e("key,rate\na,-1\n").contains("line 2"));
        assert!(e("key,rate\na,1\nb,NaN\n").contains("line 3"));
        assert!(e("key,rate\na,1\na,2\n").contains("duplicate key `a`"));
        assert!(e("key,rate,prefix_tokens\na,1,x\n").contains("prefix_tokens"));
    }

    #[test]
    fn duplicates_are_found_when_key_hashes_collide() {
        let text = "key,rate\na,1\nb,2\n\nc,3\nb,4\n";
        let e = read_rates_csv_hashed(text.as_bytes(), |_| 7).unwrap_err();
        assert!(
            matches!(&e, RatesError::Duplicate { line: 6, key, first: 3 } if key == "b"),
            "{e}"
        );
        let ok = read_rates_csv_hashed("key,rate\na,1\nb,2\nc,3\n".as_bytes(), |_| 7).unwrap();
        assert_eq!(ok.len(), 3);
    }

    #[test]
    fn whales_keep_total() {
        let mut r = vec![1.0; 100];
        add_whales(&mut r, 2, 0.5);
        let total: f64 = r.iter().sum();
        assert!((total - 100.0).abs() < 1e-9);
        assert!((r[0] - 25.0).abs() < 1e-9);
    }

    #[test]
    fn drift_preserves_total() {
        let mut rng = seeded(3);
        let mut r = lognormal_rates(1000, 1.0, 50.0, &mut rng);
        drift_step(&mut r, 0.3, &mut rng);
        assert!((r.iter().sum::<f64>() - 50.0).abs() < 1e-9);
    }
}
