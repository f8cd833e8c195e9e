//! What a model costs and how large its window is: the table compiled in from `data/prices.json`
//! (refreshed from the price table the litellm package ships, `data/refresh_prices.py`), overridden
//! per model pattern by a `models:` entry's `price:`.
//!
//! A model name is looked up as sent, then without a gateway's `provider/` prefix
//! (`anthropic/claude-sonnet-4.5`), then without a date suffix (`-20250929`, `-2024-08-06`,
//! `@20250929`). A model the table does not name has no price: pare shows its tokens only.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use regex::Regex;
use serde::Deserialize;

use crate::config::{Config, PriceConfig};

/// The table as compiled in.
pub const TABLE_JSON: &str = include_str!("../../data/prices.json");

/// Where a model's price comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PriceSource {
    /// The `price:` of the `models:` entry at this index.
    Models(usize),
    /// The built-in table.
    Table,
}

/// A model's price, USD per million tokens ([`PriceConfig`]), and where it comes from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelPrice {
    pub price: PriceConfig,
    pub source: PriceSource,
}

/// One model of the table: its window and its price.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableEntry {
    /// The most input tokens the model takes.
    pub window: u64,
    pub input: f64,
    #[serde(default)]
    pub cached: Option<f64>,
    #[serde(default)]
    pub write: Option<f64>,
    #[serde(default)]
    pub write_1h: Option<f64>,
    pub output: f64,
}

impl TableEntry {
    pub fn price(&self) -> PriceConfig {
        PriceConfig {
            input: self.input,
            cached: self.cached,
            write: self.write,
            write_1h: self.write_1h,
            output: self.output,
        }
    }
}

#[derive(Debug, Deserialize)]
struct TableFile {
    source: String,
    models: HashMap<String, TableEntry>,
}

/// The built-in table: model name → window and price.
#[derive(Debug)]
pub struct PriceTable {
    /// Where the figures come from (the litellm version), for the start-up line.
    pub source: String,
    models: HashMap<String, TableEntry>,
}

impl PriceTable {
    /// The table compiled in, parsed at its first use (about a tenth of a millisecond).
    pub fn builtin() -> &'static PriceTable {
        static TABLE: OnceLock<PriceTable> = OnceLock::new();
        TABLE.get_or_init(|| PriceTable::parse(TABLE_JSON).expect("data/prices.json is checked by its tests"))
    }

    /// A table in `data/prices.json`'s format.
    pub fn parse(json: &str) -> Result<PriceTable, serde_json::Error> {
        let file: TableFile = serde_json::from_str(json)?;
        Ok(PriceTable { source: file.source, models: file.models })
    }

    /// How many models the table names.
    pub fn len(&self) -> usize {
        self.models.len()
    }

    pub fn is_empty(&self) -> bool {
        self.models.is_empty()
    }

    /// The entry of `model`: its name as sent, without a `provider/` prefix, without a date suffix.
    pub fn get(&self, model: &str) -> Option<&TableEntry> {
        let bare = model.rsplit_once('/').map_or(model, |(_, name)| name);
        [model, bare].into_iter().find_map(|name| self.models.get(name).or_else(|| self.models.get(undated(name)?)))
    }
}

/// `name` without a trailing date (`-20250929`, `-2024-08-06`, `@20250929`), when it has one.
fn undated(name: &str) -> Option<&str> {
    static DATE: OnceLock<Regex> = OnceLock::new();
    let date = DATE.get_or_init(|| Regex::new(r"(?:[-@]\d{8}|-\d{4}-\d{2}-\d{2})$").expect("a valid pattern"));
    date.find(name).map(|m| &name[..m.start()])
}

/// Most model names whose resolved price is remembered; past it the memory starts afresh (a client
/// sending a new name on every request must not grow it without bound).
const MAX_CACHED: usize = 1024;

/// Prices by model: the `price:` of the first `models:` entry matching the model (first match wins,
/// as for every key of `models:`), else the built-in table. Each name is resolved once and remembered, so a request pays one map lookup.
#[derive(Debug)]
pub struct Prices {
    /// Every `models:` entry: its pattern, index and price.
    overrides: Vec<(Regex, usize, Option<PriceConfig>)>,
    table: &'static PriceTable,
    cache: Mutex<HashMap<String, Option<ModelPrice>>>,
}

impl Prices {
    /// The built-in table alone.
    pub fn builtin() -> Prices {
        Prices { overrides: Vec::new(), table: PriceTable::builtin(), cache: Mutex::default() }
    }

    /// The built-in table under `config.models`' prices. A pattern that is not a regular expression
    /// gives no price (the configuration check refuses it first).
    pub fn from_config(config: &Config) -> Prices {
        let overrides = config
            .models
            .iter()
            .enumerate()
            .filter_map(|(idx, m)| Some((Regex::new(&m.pattern).ok()?, idx, m.price)))
            .collect();
        Prices { overrides, ..Prices::builtin() }
    }

    /// The price of `model`; `None` for a model neither `models:` nor the table prices.
    pub fn of(&self, model: &str) -> Option<ModelPrice> {
        let mut cache = self.cache.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(found) = cache.get(model) {
            return *found;
        }
        let found = self.resolve(model);
        if cache.len() >= MAX_CACHED {
            cache.clear();
        }
        cache.insert(model.to_owned(), found);
        found
    }

    fn resolve(&self, model: &str) -> Option<ModelPrice> {
        if let Some((_, idx, Some(price))) = self.overrides.iter().find(|(re, _, _)| re.is_match(model)) {
            return Some(ModelPrice { price: *price, source: PriceSource::Models(*idx) });
        }
        let entry = self.table.get(model)?;
        Some(ModelPrice { price: entry.price(), source: PriceSource::Table })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_compiled_table_parses_and_prices_the_major_providers() {
        let table = PriceTable::builtin();
        assert!(table.len() > 100, "{} models", table.len());
        assert!(table.source.starts_with("litellm "), "{}", table.source);
        let sonnet = table.get("claude-sonnet-4-5").unwrap();
        assert_eq!((sonnet.window, sonnet.input, sonnet.output), (200_000, 3.0, 15.0));
        assert_eq!((sonnet.cached, sonnet.write, sonnet.write_1h), (Some(0.3), Some(3.75), Some(6.0)));
        for name in ["gpt-4o", "gpt-5", "gemini-2.5-pro", "deepseek-chat"] {
            let entry = table.get(name).unwrap_or_else(|| panic!("{name} missing"));
            assert!(entry.window >= 100_000 && entry.input > 0.0 && entry.output > 0.0, "{name}: {entry:?}");
            assert_eq!(entry.write, None, "{name} bills no cache writes apart");
        }
    }

    #[test]
    fn names_are_found_through_a_gateway_prefix_and_a_date_suffix() {
        let table = PriceTable::builtin();
        let sonnet = table.get("claude-sonnet-4-5");
        assert!(sonnet.is_some());
        for name in ["anthropic/claude-sonnet-4.5", "claude-sonnet-4-5@20250929", "claude-sonnet-4-5-20990101"] {
            assert_eq!(table.get(name), sonnet, "{name}");
        }
        assert_eq!(table.get("gpt-4o-2099-01-01"), table.get("gpt-4o"));
        assert_eq!(table.get("google/gemini-2.5-pro"), table.get("gemini-2.5-pro"));
        for unknown in ["qwen2.5-coder:14b", "my-local-model", "", "claude-sonnet-4-5-mine"] {
            assert_eq!(table.get(unknown), None, "{unknown}");
        }
    }

    /// The first `models:` entry that matches decides: its price wins over the table's; without one,
    /// the table's holds.
    #[test]
    fn a_models_entry_overrides_the_table() {
        let yaml = r#"
models:
  - match: "^claude-sonnet-4-5$"
    context_window: 100000
  - match: "^claude-"
    price: {input: 1.5, cached: 0.15, write: 2.0, output: 7.5}
  - match: "^my-model"
    price: {input: 0.5, output: 1.0}
"#;
        let config = Config::from_yaml(yaml).unwrap();
        let prices = Prices::from_config(&config);
        let sonnet = prices.of("claude-sonnet-4-5").unwrap();
        assert_eq!((sonnet.source, sonnet.price.input), (PriceSource::Table, 3.0));
        let opus = prices.of("claude-opus-4-5").unwrap();
        assert_eq!(opus.source, PriceSource::Models(1));
        assert_eq!((opus.price.input, opus.price.cached, opus.price.write_1h), (1.5, Some(0.15), None));
        let mine = prices.of("my-model-7b").unwrap();
        assert_eq!((mine.source, mine.price.cached, mine.price.output), (PriceSource::Models(2), None, 1.0));
        assert_eq!(prices.of("qwen3:14b"), None);
        // Resolved once, then remembered (also the absence of a price).
        assert_eq!(prices.cache.lock().unwrap().len(), 4);
        assert_eq!(prices.of("qwen3:14b"), None);
    }

    #[test]
    fn a_negative_or_missing_price_is_refused_by_the_check() {
        let err = Config::from_yaml("models:\n  - match: x\n    price: {input: -1, output: 2}\n").unwrap_err();
        assert!(err.to_string().contains("models.0.price.input"), "{err}");
        let err = Config::from_yaml("models:\n  - match: x\n    price: {input: 1}\n").unwrap_err();
        assert!(err.to_string().contains("output"), "{err}");
    }
}
