//! JSON numbers the API takes in more than one body. JSON has one number type, so a client
//! may write a count of seconds as `60` or `60.0`, and a schema-valid integer in JSON Schema
//! includes `60.0`: both are taken, a fraction is not.

use serde::Deserialize;

/// A count of seconds written `60` or `60.0` (the same number to JSON); not a fraction.
pub(super) fn whole_seconds<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<u64>, D::Error> {
    let Some(n) = Option::<serde_json::Number>::deserialize(d)? else {
        return Ok(None);
    };
    n.as_u64()
        .or_else(|| {
            n.as_f64()
                .filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f <= u32::MAX as f64)
                .map(|f| f as u64)
        })
        .map(Some)
        .ok_or_else(|| serde::de::Error::custom(format!("`{n}` is not a whole number of seconds")))
}
