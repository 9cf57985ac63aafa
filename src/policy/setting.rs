//! A setting the control loop may choose: [`Setting::Auto`] (resolved by the one controller,
//! `crate::control`, from what it measures: tuned, else estimated) or [`Setting::Fixed`] (the
//! user's value, never tuned). CacheRoute's q_cap, W and bounded sets are such settings.
//!
//! The written forms are the ones users have always written: a number of 0 (or the word
//! `auto`) is automatic for q_cap and W, and an absent or `null` `bounded_sets` is automatic.
//! This file is the one place that reads or writes those forms; everywhere else the type says
//! which it is. Pure: no I/O.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Automatic (chosen by the control loop) or fixed (as configured).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Setting<T> {
    #[default]
    Auto,
    Fixed(T),
}

impl<T: Copy> Setting<T> {
    /// The configured value, if fixed.
    pub fn fixed(self) -> Option<T> {
        match self {
            Setting::Auto => None,
            Setting::Fixed(v) => Some(v),
        }
    }

    pub fn is_auto(&self) -> bool {
        matches!(self, Setting::Auto)
    }

    /// The configured value, else `auto()`: "configured wins", written once.
    pub fn or_else(self, auto: impl FnOnce() -> T) -> T {
        self.fixed().unwrap_or_else(auto)
    }
}

/// Automatic where the written value is zero (q_cap and W: 0 has always meant "choose it").
pub trait ZeroIsAuto: Copy + PartialOrd + Default + std::str::FromStr {}
impl ZeroIsAuto for f64 {}
impl ZeroIsAuto for u64 {}

impl<T: ZeroIsAuto> Setting<T> {
    /// The setting a written number means: 0 automatic, anything else fixed. Range checks are
    /// `bounds`' (a negative q_cap is refused by the policy's validation, not here).
    pub fn from_number(v: T) -> Self {
        if v == T::default() {
            Setting::Auto
        } else {
            Setting::Fixed(v)
        }
    }

    /// The written number: 0 for automatic.
    pub fn number(self) -> T {
        self.fixed().unwrap_or_default()
    }
}

impl<T: ZeroIsAuto> std::str::FromStr for Setting<T> {
    type Err = String;
    /// `auto`, or a number (0 is automatic).
    fn from_str(s: &str) -> Result<Self, String> {
        if s.trim().eq_ignore_ascii_case("auto") {
            return Ok(Setting::Auto);
        }
        s.trim()
            .parse::<T>()
            .map(Setting::from_number)
            .map_err(|_| format!("`{s}` is neither `auto` nor a number"))
    }
}

impl<T: ZeroIsAuto + Serialize> Serialize for Setting<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.number().serialize(s)
    }
}

impl<'de, T: ZeroIsAuto + Deserialize<'de>> Deserialize<'de> for Setting<T> {
    /// A number (0 automatic) or the word `auto`.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written<T> {
            Number(T),
            Word(String),
        }
        match Written::<T>::deserialize(d)? {
            Written::Number(v) => Ok(Setting::from_number(v)),
            Written::Word(w) if w.eq_ignore_ascii_case("auto") => Ok(Setting::Auto),
            Written::Word(w) => Err(serde::de::Error::custom(format!(
                "`{w}` is neither `auto` nor a number"
            ))),
        }
    }
}

/// `bounded_sets`' written form: absent or `null` automatic, `true` / `false` fixed. Used as
/// `#[serde(with = "crate::policy::setting::optional", skip_serializing_if = "Setting::is_auto")]`.
pub mod optional {
    use super::Setting;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<T: Serialize + Copy, S: Serializer>(
        v: &Setting<T>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        v.fixed().serialize(s)
    }

    pub fn deserialize<'de, T: Deserialize<'de>, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Setting<T>, D::Error> {
        Ok(match Option::<T>::deserialize(d)? {
            None => Setting::Auto,
            Some(v) => Setting::Fixed(v),
        })
    }
}

/// A choice among named values (CacheRoute's cold tail and load signal).
pub trait Named: Copy + 'static {
    /// Every value, in the order an error lists them.
    const ALL: &'static [Self];
    fn name(self) -> &'static str;
}

impl Named for crate::analysis::record::ColdTail {
    const ALL: &'static [Self] = &[Self::P2c, Self::Chwbl, Self::Prefix];
    fn name(self) -> &'static str {
        Self::name(self)
    }
}

impl Named for crate::analysis::record::LoadSignal {
    const ALL: &'static [Self] = &[Self::Outstanding, Self::Prefill, Self::Cost];
    fn name(self) -> &'static str {
        Self::name(self)
    }
}

impl<T: Named> Setting<T> {
    /// `auto`, or one of the names.
    pub fn parse_named(s: &str) -> Result<Self, String> {
        let w = s.trim();
        if w.eq_ignore_ascii_case("auto") {
            return Ok(Setting::Auto);
        }
        T::ALL
            .iter()
            .find(|v| v.name() == w)
            .map(|&v| Setting::Fixed(v))
            .ok_or_else(|| {
                let names: Vec<&str> = T::ALL.iter().map(|v| v.name()).collect();
                format!("`{w}` is not one of auto, {}", names.join(", "))
            })
    }
}

/// The written form of a named choice: absent, `null` or `auto` automatic, a name fixed. Used
/// as `#[serde(with = "crate::policy::setting::named", skip_serializing_if = "Setting::is_auto")]`.
pub mod named {
    use super::{Named, Setting};
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<T: Named, S: Serializer>(v: &Setting<T>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Setting::Auto => s.serialize_str("auto"),
            Setting::Fixed(v) => s.serialize_str(v.name()),
        }
    }

    pub fn deserialize<'de, T: Named, D: Deserializer<'de>>(d: D) -> Result<Setting<T>, D::Error> {
        match Option::<String>::deserialize(d)? {
            None => Ok(Setting::Auto),
            Some(w) => Setting::parse_named(&w).map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct C {
        q: Setting<f64>,
        w: Setting<u64>,
        #[serde(default, with = "optional", skip_serializing_if = "Setting::is_auto")]
        b: Setting<bool>,
    }

    #[test]
    fn zero_and_auto_read_as_automatic_and_write_back_as_zero() {
        let c: C = serde_json::from_str(r#"{"q": 0, "w": "auto"}"#).unwrap();
        assert_eq!(
            c,
            C {
                q: Setting::Auto,
                w: Setting::Auto,
                b: Setting::Auto
            }
        );
        assert_eq!(serde_json::to_string(&c).unwrap(), r#"{"q":0.0,"w":0}"#);
        let c: C = serde_json::from_str(r#"{"q": 2.5, "w": 64, "b": false}"#).unwrap();
        assert_eq!(
            c,
            C {
                q: Setting::Fixed(2.5),
                w: Setting::Fixed(64),
                b: Setting::Fixed(false)
            }
        );
        assert_eq!(
            serde_json::to_string(&c).unwrap(),
            r#"{"q":2.5,"w":64,"b":false}"#
        );
        let c: C = serde_json::from_str(r#"{"q": 1, "w": 1, "b": null}"#).unwrap();
        assert_eq!(c.b, Setting::Auto);
    }

    #[test]
    fn a_word_other_than_auto_is_refused_naming_it() {
        let e = serde_json::from_str::<C>(r#"{"q": "often", "w": 0}"#).unwrap_err();
        assert!(e.to_string().contains("`often`"), "{e}");
        assert!("often".parse::<Setting<u64>>().is_err());
        assert_eq!("auto".parse::<Setting<u64>>(), Ok(Setting::Auto));
        assert_eq!("0".parse::<Setting<f64>>(), Ok(Setting::Auto));
        assert_eq!("3".parse::<Setting<u64>>(), Ok(Setting::Fixed(3)));
    }

    #[test]
    fn configured_wins_and_automatic_asks() {
        assert_eq!(Setting::Fixed(4u64).or_else(|| 9), 4);
        assert_eq!(Setting::<u64>::Auto.or_else(|| 9), 9);
        assert_eq!(Setting::<f64>::Auto.number(), 0.0);
    }
}
