//! Admission (steps 1–2 of Algorithm 1): each key's k_b, the scan of the measured rates, the
//! candidates in decreasing rate order (hysteresis for keys admitted before), and byte-aware
//! admission by value per KV slot.

use super::*;

/// Slot cost of an admitted key: k_b, or k_b × blocks with byte-aware admission.
#[inline]
pub(super) fn slot_cost(cfg: &PlannerConfig, k: usize, prefix_tokens: f64) -> u64 {
    if cfg.byte_aware {
        let blocks = (prefix_tokens.max(0.0) / cfg.block_tokens as f64)
            .ceil()
            .max(1.0) as u64;
        k as u64 * blocks
    } else {
        k as u64
    }
}

/// Result of admission: the admitted keys as plan entries with k_b set (not yet placed), in
/// placement order (decreasing rate, ties by key hash).
pub(super) struct Admission {
    pub(super) entries: Vec<PlanEntry>,
    pub(super) slots_used: u64,
    pub(super) admitted_rate: f64,
    pub(super) total_rate: f64,
    /// Memory the sort used and no longer needs, for the dispatch index (may be empty).
    pub(super) scratch: Vec<u32>,
}

/// What one pass over the input learns: every rate is a finite number ≥ 0 (else the first
/// that is not), their sum, and the range of the IEEE bits of the rates as admission orders
/// them (rates ≤ 0 as +0). The sum is taken in chunks of [`SCAN_CHUNK`] keys, each in input
/// order, and the chunk sums are added in chunk order: the same number whichever thread read
/// which chunk (the large plans' sort reads them on two, [`bucket_sorted`]).
#[derive(Clone, Copy)]
pub(super) struct KeyScan {
    pub(super) total_rate: f64,
    pub(super) bits_lo: u64,
    pub(super) bits_hi: u64,
}

/// Keys per chunk of [`KeyScan`]'s sum.
pub(super) const SCAN_CHUNK: usize = 4096;

/// One chunk of [`KeyScan`]: `keys` starts at input index `first`.
pub(super) fn scan_chunk(keys: &[KeyLoad], first: usize) -> Result<KeyScan, PlanError> {
    let mut total_rate = 0.0;
    let (mut lo, mut hi) = (u64::MAX, 0u64);
    for (i, k) in keys.iter().enumerate() {
        let r = k.rate;
        if !(r.is_finite() && r >= 0.0) {
            return Err(PlanError::BadRate {
                index: first + i,
                rate: r,
            });
        }
        total_rate += r;
        let b = if r > 0.0 { r.to_bits() } else { 0 };
        lo = lo.min(b);
        hi = hi.max(b);
    }
    Ok(KeyScan {
        total_rate,
        bits_lo: lo,
        bits_hi: hi,
    })
}

/// Chunk scans, in chunk order, folded into the whole input's (the first bad rate, if any).
pub(super) fn fold_scans(
    mut chunks: impl Iterator<Item = Result<KeyScan, PlanError>>,
) -> Result<KeyScan, PlanError> {
    let empty = KeyScan {
        total_rate: 0.0,
        bits_lo: u64::MAX,
        bits_hi: 0,
    };
    chunks.try_fold(empty, |a, c| {
        let c = c?;
        Ok(KeyScan {
            total_rate: a.total_rate + c.total_rate,
            bits_lo: a.bits_lo.min(c.bits_lo),
            bits_hi: a.bits_hi.max(c.bits_hi),
        })
    })
}

pub(super) fn scan_keys(keys: &[KeyLoad]) -> Result<KeyScan, PlanError> {
    fold_scans(
        keys.chunks(SCAN_CHUNK)
            .enumerate()
            .map(|(c, ks)| scan_chunk(ks, c * SCAN_CHUNK)),
    )
}

/// Previously admitted keys and the admission hysteresis they enjoy (churn-aware replanning):
/// such a key is ordered as if its rate were × (1 + hysteresis).
#[derive(Clone, Copy)]
pub(super) struct Incumbents<'a> {
    pub(super) keys: Option<&'a KeyMap<Vec<u16>>>,
    pub(super) hysteresis: f64,
}

impl Incumbents<'_> {
    pub(super) const NONE: Incumbents<'static> = Incumbents {
        keys: None,
        hysteresis: 0.0,
    };
    #[inline]
    pub(super) fn boost(&self, key: u64) -> f64 {
        match self.keys {
            Some(m) if self.hysteresis > 0.0 && m.contains_key(&key) => 1.0 + self.hysteresis,
            _ => 1.0,
        }
    }
}

/// Admission order: decreasing rate, then increasing key hash. Entries being admitted hold
/// rates ≥ +0 (−0 and ≤ 0 are stored as +0), whose IEEE bits order like the numbers, so the
/// sort compares plain integers.
#[inline]
pub(super) fn by_rate_then_key(a: &PlanEntry, b: &PlanEntry) -> Ordering {
    b.rate
        .to_bits()
        .cmp(&a.rate.to_bits())
        .then(a.key.cmp(&b.key))
}

/// The budget rule. The candidates are the plan entries themselves (key, rate and input index
/// side by side, one allocation): sorting them needs no indirection into `keys`, and the
/// admitted ones are compacted to the front and become the plan's entries.
///
/// The input's pass ([`scan_keys`]: validation, sum, range) is done here, and on a large
/// input where the whole order is sorted without incumbents it is the sort's counting pass.
pub(super) fn admit(
    cfg: &PlannerConfig,
    keys: &[KeyLoad],
    r_live: usize,
    inc: Incumbents,
) -> Result<Admission, PlanError> {
    let budget = cfg.warm_slots.saturating_mul(r_live as u64);
    let n = keys.len();
    let whole_order = !cfg.byte_aware && (budget as usize).saturating_mul(2) >= n;
    let fused = whole_order && inc.keys.is_none();
    let scan = if fused { None } else { Some(scan_keys(keys)?) };
    if cfg.byte_aware {
        let total = scan.expect("scanned").total_rate;
        return Ok(admit_byte_aware(cfg, keys, total, r_live, inc));
    }
    // While admitting, `rate` holds the effective rate (× (1 + hysteresis) for incumbents),
    // with rates ≤ 0 as +0.
    let boosted: Option<Vec<f64>> = inc
        .keys
        .map(|_| keys.iter().map(|k| k.rate * inc.boost(k.key)).collect());
    let eff = |i: usize| {
        let e = match &boosted {
            Some(b) => b[i],
            None => keys[i].rate,
        };
        if e > 0.0 {
            e
        } else {
            0.0
        }
    };
    // k = 1 until admission says otherwise (the common case needs no second write).
    let candidate = |i: usize| PlanEntry {
        key: keys[i].key,
        rate: eff(i),
        input_index: i as u32,
        k: 1,
    };
    let mut sorted = n;
    let mut cands: Vec<PlanEntry>;
    let total_rate;
    let mut scratch = Vec::new();
    if !whole_order {
        total_rate = scan.expect("scanned").total_rate;
        // Only the top of the order can be admitted: at most `budget` keys fit. Select a
        // prefix that is large enough in O(n) and sort just that; the rest is sorted only if
        // skipped keys leave budget unused at the prefix's end (the selection leaves it after
        // the prefix, so the scan simply continues).
        cands = (0..n).map(candidate).collect();
        sorted = (budget as usize * 2).max(1024).min(n);
        if sorted < n {
            cands.select_nth_unstable_by(sorted - 1, by_rate_then_key);
        }
        cands[..sorted].sort_unstable_by(by_rate_then_key);
    } else {
        let range = match (&boosted, scan) {
            (None, Some(sc)) => SortRange::Known(sc.bits_lo, sc.bits_hi),
            (None, None) => SortRange::Scan(keys),
            (Some(_), _) => {
                let (lo, hi) = (0..n).fold((u64::MAX, 0), |(lo, hi), i| {
                    let b = eff(i).to_bits();
                    (lo.min(b), hi.max(b))
                });
                SortRange::Known(lo, hi)
            }
        };
        let sorted = bucket_sorted(n, range, eff, candidate, None)?;
        cands = sorted.cands;
        scratch = sorted.scratch;
        total_rate = sorted
            .total_rate
            .or(scan.map(|s| s.total_rate))
            .expect("scanned");
    }
    // Once every later key costs one slot (its rate is at most q_cap, or no replication),
    // admission is a prefix of the order: no per-key decision is left. With incumbents the
    // order is by boosted rates while k follows true ones, so the scan stays per key.
    let unit_tail = |rate: f64| inc.keys.is_none() && (!cfg.replication || rate <= cfg.q_cap);
    let mut used = 0u64;
    let mut admitted = 0usize;
    let mut admitted_rate = 0.0;
    let mut next = 0usize;
    'scan: loop {
        let mut j = next;
        while j < sorted {
            let c = cands[j];
            if c.rate == 0.0 {
                // A key with no traffic gains nothing from a warm slot (and all after it are 0).
                break 'scan;
            }
            let rate = match inc.keys {
                Some(_) => keys[c.input_index as usize].rate,
                None => c.rate,
            };
            if unit_tail(rate) {
                let live = cands[j..sorted].partition_point(|e| e.rate > 0.0);
                let take = (live as u64).min(budget - used) as usize;
                if admitted != j {
                    cands.copy_within(j..j + take, admitted);
                }
                for e in &cands[admitted..admitted + take] {
                    admitted_rate += e.rate;
                }
                used += take as u64;
                admitted += take;
                j += take;
                if used == budget || take < sorted - (j - take) {
                    // The budget is full, or the keys left send nothing.
                    break 'scan;
                }
                continue;
            }
            let kb = if cfg.replication {
                replicas_for(rate, cfg.q_cap, r_live)
            } else {
                1
            };
            let cost = kb as u64;
            if used + cost <= budget {
                used += cost;
                cands[admitted] = PlanEntry {
                    rate,
                    k: kb as u16,
                    ..c
                };
                admitted += 1;
                admitted_rate += rate;
                if used == budget {
                    break 'scan;
                }
            }
            j += 1;
        }
        if sorted == n {
            break;
        }
        next = sorted;
        sorted = n;
        cands[next..].sort_unstable_by(by_rate_then_key);
    }
    cands.truncate(admitted);
    if inc.keys.is_some() {
        // Admitted in order of boosted rates; placed in order of true ones.
        placement_order(&mut cands);
    }
    Ok(Admission {
        entries: cands,
        slots_used: used,
        admitted_rate,
        total_rate,
        scratch,
    })
}

/// Byte-aware admission: keys by decreasing value per slot (rate × prefix tokens per KV block
/// of its k_b copies).
pub(super) fn admit_byte_aware(
    cfg: &PlannerConfig,
    keys: &[KeyLoad],
    total_rate: f64,
    r_live: usize,
    inc: Incumbents,
) -> Admission {
    let budget = cfg.warm_slots.saturating_mul(r_live as u64);
    let kb_of = |k: &KeyLoad| {
        if cfg.replication {
            replicas_for(k.rate, cfg.q_cap, r_live)
        } else {
            1
        }
    };
    let dens = |i: u32| {
        let k = &keys[i as usize];
        inc.boost(k.key) * k.rate * k.prefix_tokens.max(0.0)
            / slot_cost(cfg, kb_of(k), k.prefix_tokens) as f64
    };
    // Ties by key hash, so the order never depends on input order.
    let mut idx: Vec<u32> = (0..keys.len() as u32).collect();
    idx.sort_unstable_by(|&a, &b| {
        dens(b)
            .total_cmp(&dens(a))
            .then_with(|| keys[a as usize].key.cmp(&keys[b as usize].key))
    });
    let mut used = 0u64;
    let mut entries = Vec::new();
    let mut admitted_rate = 0.0;
    for &i in &idx {
        let k = &keys[i as usize];
        if k.rate <= 0.0 {
            continue;
        }
        let kb = kb_of(k);
        let cost = slot_cost(cfg, kb, k.prefix_tokens);
        if used + cost <= budget {
            used += cost;
            entries.push(PlanEntry {
                key: k.key,
                rate: k.rate,
                input_index: i,
                k: kb as u16,
            });
            admitted_rate += k.rate;
            if used == budget {
                break;
            }
        }
    }
    placement_order(&mut entries);
    Admission {
        entries,
        slots_used: used,
        admitted_rate,
        total_rate,
        scratch: Vec::new(),
    }
}
