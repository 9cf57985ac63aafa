//! Reading and writing JSON values without indexing (the router's no-panic rule): a missing
//! field reads as `null`, a field written into a value that is not an object is not written.

use serde_json::Value;

/// The value at JSON pointer `path` (`/header/revision`), `null` when there is none.
pub(crate) fn at<'a>(v: &'a Value, path: &str) -> &'a Value {
    v.pointer(path).unwrap_or(&Value::Null)
}

/// Set `key` in object `v` (nothing when `v` is not an object).
pub(crate) fn set(v: &mut Value, key: &str, value: Value) {
    if let Some(o) = v.as_object_mut() {
        o.insert(key.to_string(), value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_fields_read_as_null_and_non_objects_are_left_alone() {
        let v = serde_json::json!({"header": {"revision": "7"}, "list": [1, {"a": 2}]});
        assert_eq!(at(&v, "/header/revision"), "7");
        assert_eq!(at(&v, "/list/1/a"), 2);
        assert!(at(&v, "/nope/x").is_null() && at(&v, "/list/9").is_null());
        let mut o = serde_json::json!({});
        set(&mut o, "k", 1.into());
        assert_eq!(o["k"], 1);
        let mut arr = serde_json::json!([1]);
        set(&mut arr, "k", 1.into());
        assert_eq!(arr, serde_json::json!([1]));
    }
}
