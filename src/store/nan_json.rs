//! Read back JSON written by `serde_json` from structs holding `f64`s that may be NaN.
//!
//! `serde_json` writes a non-finite `f64` as `null` but refuses `null` for an `f64` when reading.
//! [`from_str`] reads such text with one change: `null` where an `f64`/`f32` is expected becomes
//! NaN. Everything else behaves as `serde_json::from_str` (options still read `null` as `None`).
//! Enum payloads are read by `serde_json` itself, without the NaN rule (the model has none).
//! Pure; depends on nothing of the crate.

use serde::de::value::BorrowedStrDeserializer;
use serde::de::{self, DeserializeOwned, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde::forward_to_deserialize_any;
use serde_json::Value;

/// Parse `text` into `T`, reading `null` as NaN where a float is expected.
pub fn from_str<T: DeserializeOwned>(text: &str) -> Result<T, serde_json::Error> {
    let value: Value = serde_json::from_str(text)?;
    T::deserialize(NullIsNan(&value))
}

struct NullIsNan<'de>(&'de Value);

impl<'de> de::Deserializer<'de> for NullIsNan<'de> {
    type Error = serde_json::Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.0 {
            Value::Array(items) => visitor.visit_seq(Seq(items.iter())),
            Value::Object(map) => visitor.visit_map(Map {
                entries: map.iter(),
                value: None,
            }),
            scalar => de::Deserializer::deserialize_any(scalar, visitor),
        }
    }

    fn deserialize_f64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.0 {
            Value::Null => visitor.visit_f64(f64::NAN),
            other => de::Deserializer::deserialize_f64(other, visitor),
        }
    }

    fn deserialize_f32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.0 {
            Value::Null => visitor.visit_f32(f32::NAN),
            other => de::Deserializer::deserialize_f32(other, visitor),
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.0 {
            Value::Null => visitor.visit_none(),
            _ => visitor.visit_some(self),
        }
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        de::Deserializer::deserialize_enum(self.0, name, variants, visitor)
    }

    forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 char str string bytes byte_buf unit
        unit_struct seq tuple tuple_struct map struct identifier ignored_any
    }
}

struct Seq<'de>(std::slice::Iter<'de, Value>);

impl<'de> SeqAccess<'de> for Seq<'de> {
    type Error = serde_json::Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Self::Error> {
        self.0
            .next()
            .map(|v| seed.deserialize(NullIsNan(v)))
            .transpose()
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.0.len())
    }
}

struct Map<'de> {
    entries: serde_json::map::Iter<'de>,
    value: Option<&'de Value>,
}

impl<'de> MapAccess<'de> for Map<'de> {
    type Error = serde_json::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Self::Error> {
        match self.entries.next() {
            Some((key, value)) => {
                self.value = Some(value);
                seed.deserialize(BorrowedStrDeserializer::<serde_json::Error>::new(key))
                    .map(Some)
            }
            None => Ok(None),
        }
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, Self::Error> {
        match self.value.take() {
            Some(value) => seed.deserialize(NullIsNan(value)),
            None => Err(de::Error::custom("map value requested before its key")),
        }
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.entries.len())
    }
}

#[cfg(test)]
mod tests {
    use crate::analysis::model::{Fairness, StepMetrics};

    #[test]
    fn nan_survives_a_round_trip_and_finite_values_are_exact() {
        let m = StepMetrics {
            offered_qps: 42.5,
            e2e_p99_s: f64::NAN,
            requests: 7,
            fairness: Fairness {
                e2e_p99_by_rate_decile_s: vec![0.1, f64::NAN, 3.25],
                jain_index: 0.9,
            },
            ..StepMetrics::default()
        };
        let text = serde_json::to_string(&m).unwrap();
        assert!(serde_json::from_str::<StepMetrics>(&text).is_err());
        let back: StepMetrics = super::from_str(&text).unwrap();
        assert_eq!(back.offered_qps, 42.5);
        assert!(back.e2e_p99_s.is_nan());
        assert_eq!(back.requests, 7);
        let d = &back.fairness.e2e_p99_by_rate_decile_s;
        assert_eq!((d[0], d[2]), (0.1, 3.25));
        assert!(d[1].is_nan());
        assert_eq!(back.fairness.jain_index, 0.9);
    }

    #[test]
    fn options_still_read_null_as_none_and_errors_still_fail() {
        let v: Vec<Option<f64>> = super::from_str("[null, 1.5]").unwrap();
        assert_eq!(v, vec![None, Some(1.5)]);
        assert!(super::from_str::<StepMetrics>("{\"requests\": \"x\"}").is_err());
    }
}
