//! The fast path of [`super::parse_line`]: accepts only plain lines and gives up (`None`) on anything
//! else, leaving it to serde_json. Whatever it accepts, it must read exactly as serde_json does.

use super::{RawRecord, StrOrNum};
use std::borrow::Cow;

/// Exact powers of ten (every one up to 1e22 is representable).
const POW10: [f64; 23] = [
    1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16,
    1e17, 1e18, 1e19, 1e20, 1e21, 1e22,
];

struct Cur<'a> {
    s: &'a str,
    b: &'a [u8],
    i: usize,
}

impl<'a> Cur<'a> {
    #[inline]
    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.b.get(self.i) {
            self.i += 1;
        }
    }

    #[inline]
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    #[inline]
    fn eat(&mut self, c: u8) -> Option<()> {
        if self.peek() == Some(c) {
            self.i += 1;
            Some(())
        } else {
            None
        }
    }

    /// A string without escapes or control characters.
    #[inline]
    fn string(&mut self) -> Option<&'a str> {
        self.eat(b'"')?;
        let start = self.i;
        loop {
            match *self.b.get(self.i)? {
                b'"' => break,
                b'\\' => return None,
                c if c < 0x20 => return None,
                _ => self.i += 1,
            }
        }
        let s = self.s.get(start..self.i)?;
        self.i += 1;
        Some(s)
    }

    /// Digits of a JSON integer (no sign, no leading zero), at most `max` of them, and
    /// fitting a u64; the number must end here (no fraction or exponent).
    #[inline]
    fn digits(&mut self, max: usize) -> Option<(u64, usize)> {
        let start = self.i;
        let mut v: u64 = 0;
        while let Some(&c) = self.b.get(self.i) {
            if !c.is_ascii_digit() {
                break;
            }
            v = v.checked_mul(10)?.checked_add((c - b'0') as u64)?;
            self.i += 1;
        }
        let n = self.i - start;
        if n == 0 || n > max || (n > 1 && self.b[start] == b'0') {
            return None;
        }
        Some((v, n))
    }

    #[inline]
    fn end_of_number(&self) -> Option<()> {
        match self.peek() {
            Some(b'.' | b'e' | b'E' | b'-' | b'+') => None,
            _ => Some(()),
        }
    }

    #[inline]
    fn uint(&mut self, max: usize) -> Option<u64> {
        let (v, _) = self.digits(max)?;
        self.end_of_number()?;
        Some(v)
    }

    /// `int` or `int.frac` with at most 15 significant digits: exactly what serde_json
    /// (and a correctly rounded parser) gives, `sig / 10^frac` being exact-then-rounded.
    fn timestamp(&mut self) -> Option<f64> {
        let (int, n) = self.digits(15)?;
        if self.peek() != Some(b'.') {
            self.end_of_number()?;
            return Some(int as f64);
        }
        self.i += 1;
        let start = self.i;
        let mut frac: u64 = 0;
        while let Some(&c) = self.b.get(self.i) {
            if !c.is_ascii_digit() {
                break;
            }
            frac = frac * 10 + (c - b'0') as u64;
            self.i += 1;
            if n + (self.i - start) > 15 {
                return None;
            }
        }
        let k = self.i - start;
        if k == 0 {
            return None;
        }
        self.end_of_number()?;
        let sig = int * 10u64.pow(k as u32) + frac;
        Some(sig as f64 / POW10[k])
    }

    /// The value of a field the record does not have, when it is plain — a string without
    /// escapes, an unsigned number (`int` or `int.frac`), `true`, `false` or `null` —
    /// skipped as serde_json skips it (valid, then ignored). Anything else (objects, arrays,
    /// escapes, signs, exponents) gives up.
    fn skip_plain(&mut self) -> Option<()> {
        let lit = |c: &mut Self, w: &[u8]| {
            if c.b.get(c.i..c.i + w.len())? == w {
                c.i += w.len();
                Some(())
            } else {
                None
            }
        };
        match self.peek()? {
            b'"' => self.string().map(|_| ()),
            b't' => lit(self, b"true"),
            b'f' => lit(self, b"false"),
            b'n' => lit(self, b"null"),
            b'0'..=b'9' => {
                self.digits(19)?;
                if self.eat(b'.').is_some() {
                    let start = self.i;
                    while self.peek().is_some_and(|c| c.is_ascii_digit()) {
                        self.i += 1;
                    }
                    if self.i == start {
                        return None;
                    }
                }
                self.end_of_number()
            }
            _ => None,
        }
    }

    fn ids(&mut self) -> Option<Vec<u64>> {
        self.eat(b'[')?;
        self.ws();
        let mut v = Vec::new();
        if self.eat(b']').is_some() {
            return Some(v);
        }
        loop {
            v.push(self.uint(20)?);
            self.ws();
            match self.peek()? {
                b',' => {
                    self.i += 1;
                    self.ws();
                }
                b']' => {
                    self.i += 1;
                    return Some(v);
                }
                _ => return None,
            }
        }
    }
}

pub(super) fn parse(text: &str) -> Option<RawRecord<'_>> {
    let mut c = Cur {
        s: text,
        b: text.as_bytes(),
        i: 0,
    };
    let mut raw = RawRecord {
        timestamp: None,
        key: None,
        input_length: None,
        output_length: None,
        hash_ids: None,
        session: None,
        turn: None,
    };
    let mut seen = 0u8;
    c.ws();
    c.eat(b'{')?;
    c.ws();
    loop {
        let name = c.string()?;
        c.ws();
        c.eat(b':')?;
        c.ws();
        let bit = match name {
            "timestamp" => {
                raw.timestamp = Some(c.timestamp()?);
                1
            }
            "key" => {
                raw.key = Some(Cow::Borrowed(c.string()?));
                2
            }
            "input_length" => {
                raw.input_length = Some(crate::bounds::JsonWhole::Int(c.uint(18)? as i64));
                4
            }
            "output_length" => {
                raw.output_length = Some(crate::bounds::JsonWhole::Int(c.uint(18)? as i64));
                8
            }
            "hash_ids" => {
                raw.hash_ids = Some(c.ids()?);
                16
            }
            "session" => {
                raw.session = Some(StrOrNum::S(Cow::Borrowed(c.string()?)));
                32
            }
            "turn" => {
                raw.turn = Some(c.uint(9)? as u32);
                64
            }
            // Another field (e.g. the router's recording adds `destination`, `status`,
            // `ttft_ms`): ignored, as serde_json ignores it, repeats included.
            _ => {
                c.skip_plain()?;
                0
            }
        };
        if seen & bit != 0 {
            return None;
        }
        seen |= bit;
        c.ws();
        match c.peek()? {
            b',' => {
                c.i += 1;
                c.ws();
            }
            b'}' => {
                c.i += 1;
                break;
            }
            _ => return None,
        }
    }
    c.ws();
    (c.i == c.b.len()).then_some(raw)
}
