//! Layering: the file, then one `CALLBACKD__SECTION__KEY` environment variable per overridden
//! key, then serde, whose errors name the key through `serde_path_to_error`.
//!
//! `figment` and the `config` crate layer the same way, but each reads an environment value
//! without knowing the key it is for (`123456` becomes a number and then fails as a token),
//! words its errors its own way, and would still need the key-naming mapping below; the loader
//! here is the smaller of the two.

use std::path::{Path, PathBuf};

use super::{CONFIG_ENV, Config, ConfigError, DEFAULT_CONFIG_PATH, OVERRIDE_PREFIX, invalid};

impl Config {
    /// Loads the file at `path` (or, when `None`, `$CALLBACKD_CONFIG`, else `./config.toml`),
    /// applies the environment overrides in `env` and validates the result.
    pub fn load(
        path: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let env: Vec<(String, String)> = env.into_iter().collect();
        let path = match path {
            Some(p) => p.to_path_buf(),
            None => env
                .iter()
                .find(|(k, _)| k == CONFIG_ENV)
                .map(|(_, v)| PathBuf::from(v))
                .unwrap_or_else(|| PathBuf::from(DEFAULT_CONFIG_PATH)),
        };
        let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Read {
            path: path.clone(),
            source,
        })?;
        Self::from_toml_str(&text, &path, env)
    }

    pub fn from_toml_str(
        text: &str,
        path: &Path,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let file: toml::Table = text
            .parse()
            .map_err(|e: toml::de::Error| ConfigError::Syntax {
                path: path.to_path_buf(),
                message: e.message().to_string(),
            })?;
        let mut overrides: Vec<Override> = env
            .into_iter()
            .filter_map(|(var, value)| Override::new(var, &value))
            .collect();
        let config = deserialize(&file, &mut overrides)?;
        config.validate()?;
        Ok(config)
    }
}

/// Deserializes the file with the overrides on top. An override that does not fit its key
/// read one way is read the next way (see [`Override::new`]); when no reading fits, the error
/// is the one of its first reading, as if there were no others.
fn deserialize(file: &toml::Table, overrides: &mut [Override]) -> Result<Config, ConfigError> {
    loop {
        let mut table = file.clone();
        for o in overrides.iter() {
            o.apply(&mut table)?;
        }
        let err = match serde_path_to_error::deserialize(toml::Value::Table(table)) {
            Ok(config) => return Ok(config),
            Err(e) => e,
        };
        let key = err.path().to_string();
        let error = invalid(&key, err.inner().message());
        // The value at `key` came from the last override applied over it.
        let Some(o) = overrides.iter_mut().rev().find(|o| o.covers(&key)) else {
            return Err(error);
        };
        if o.reading + 1 >= o.readings.len() {
            return Err(o.first_error.take().unwrap_or(error));
        }
        o.first_error.get_or_insert(error);
        o.reading += 1;
    }
}

/// One `CALLBACKD__...` variable: the key it sets and what its value can mean.
struct Override {
    var: String,
    /// Lower-cased key segments: `CALLBACKD__STORE__URL` → `["store", "url"]`.
    segments: Vec<String>,
    /// The dotted key, as serde names it in errors.
    key: String,
    /// Most likely first; `reading` is the one in use.
    readings: Vec<toml::Value>,
    reading: usize,
    first_error: Option<ConfigError>,
}

impl Override {
    /// `None` for a variable that is not an override.
    ///
    /// The value is read as TOML when it parses as one (`64`, `true`, `["a","b"]`), and as a
    /// plain string otherwise, so `CALLBACKD__STORE__URL=redis://...` needs no quoting. Which
    /// reading is right depends on the key, so a scalar (`123456`, `true`, `1979-05-27`) is also
    /// tried as the text it was written as: a token or secret of digits stays a string. A
    /// list key also takes a single item (`CALLBACKD__AUTH__ADMIN_TOKENS=...`) unless the
    /// value starts like a list.
    fn new(var: String, raw: &str) -> Option<Override> {
        let path = var.strip_prefix(OVERRIDE_PREFIX)?;
        let segments: Vec<String> = path.split("__").map(|s| s.to_ascii_lowercase()).collect();
        let parsed = format!("v = {raw}")
            .parse::<toml::Table>()
            .ok()
            .and_then(|mut t| t.remove("v"));
        let text = || toml::Value::String(raw.to_string());
        let mut readings = Vec::new();
        let item = match parsed {
            Some(toml::Value::String(s)) => Some(toml::Value::String(s)),
            Some(structured @ (toml::Value::Array(_) | toml::Value::Table(_))) => {
                readings.push(structured);
                None
            }
            Some(scalar) => {
                readings.push(scalar);
                Some(text())
            }
            None => Some(text()),
        };
        if let Some(item) = item {
            readings.push(item.clone());
            if !raw.trim_start().starts_with('[') {
                readings.push(toml::Value::Array(vec![item]));
            }
        }
        Some(Override {
            key: segments.join("."),
            var,
            segments,
            readings,
            reading: 0,
            first_error: None,
        })
    }

    /// Whether a deserialization error at `key` is about this override's value.
    fn covers(&self, key: &str) -> bool {
        key.strip_prefix(self.key.as_str())
            .is_some_and(|rest| rest.is_empty() || rest.starts_with(['.', '[']))
    }

    /// Sets `section.key[.key...]` in the parsed file to the reading in use.
    fn apply(&self, table: &mut toml::Table) -> Result<(), ConfigError> {
        let error = |message: String| ConfigError::Override {
            var: self.var.clone(),
            message,
        };
        if self.segments.iter().any(|s| s.is_empty()) {
            return Err(error("empty key segment".into()));
        }
        let (last, parents) = self
            .segments
            .split_last()
            .ok_or_else(|| error("empty key segment".into()))?;
        let mut node = table;
        for segment in parents {
            let entry = node
                .entry(segment.clone())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            node = entry
                .as_table_mut()
                .ok_or_else(|| error(format!("`{segment}` is not a table")))?;
        }
        node.insert(last.clone(), self.readings[self.reading].clone());
        Ok(())
    }
}
