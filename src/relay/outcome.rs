//! What the relay's batches carry whatever the engine: a claimed record with its fencing
//! token, the outcome of each, and what can make a row undecodable.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Bytea, Nullable, Text, Timestamptz};

use crate::publisher::Record;

/// `last_error` is cut to at most this many bytes.
pub(crate) const MAX_ERROR_BYTES: usize = 2_000;

/// Outcome kinds bound into `RecordOutcomes::kinds`.
pub(crate) const OUTCOME_SENT: &str = "sent";
pub(crate) const OUTCOME_RETRY: &str = "retry";
pub(crate) const OUTCOME_DEAD: &str = "dead";
pub(crate) const OUTCOME_RELEASE: &str = "release";
/// A row of the log handed to the per-row side without an attempt charged: a delayed
/// message, or one behind its aggregate's rows on the per-row side.
pub(crate) const OUTCOME_MOVE: &str = "move";

/// A claimed record with the fencing token its outcome must carry.
#[derive(Debug)]
pub(crate) struct Claimed {
    pub(crate) record: Record,
    pub(crate) token: i64,
}

/// The outcome of one claimed row, fenced by its token.
#[derive(Debug, Clone)]
pub(crate) struct Outcome {
    pub(crate) id: i64,
    pub(crate) token: i64,
    /// The attempt this outcome closes (the row's `attempts` afterwards, less one for a
    /// release, which gives the attempt back).
    pub(crate) attempt: u32,
    pub(crate) kind: &'static str,
    pub(crate) delay: Duration,
    pub(crate) error: Option<String>,
}

impl Outcome {
    pub(crate) fn sent(r: &Record, token: i64) -> Self {
        Self::new(r, token, OUTCOME_SENT, Duration::ZERO, None)
    }

    pub(crate) fn retry(
        r: &Record,
        token: i64,
        delay: Duration,
        error: &dyn std::fmt::Display,
    ) -> Self {
        Self::new(r, token, OUTCOME_RETRY, delay, Some(error_text(error)))
    }

    pub(crate) fn dead(r: &Record, token: i64, error: &dyn std::fmt::Display) -> Self {
        Self::new(
            r,
            token,
            OUTCOME_DEAD,
            Duration::ZERO,
            Some(error_text(error)),
        )
    }

    pub(crate) fn release(r: &Record, token: i64) -> Self {
        Self::new(r, token, OUTCOME_RELEASE, Duration::ZERO, None)
    }

    /// A row of the log handed to the per-row side without an attempt charged.
    pub(crate) fn moved(id: i64) -> Self {
        Outcome {
            id,
            token: 0,
            attempt: 0,
            kind: OUTCOME_MOVE,
            delay: Duration::ZERO,
            error: None,
        }
    }

    fn new(
        r: &Record,
        token: i64,
        kind: &'static str,
        delay: Duration,
        error: Option<String>,
    ) -> Self {
        Outcome {
            id: r.id,
            token,
            attempt: r.attempt,
            kind,
            delay,
            error,
        }
    }
}

/// Planner settings for the claim. It must walk the partial indexes in id order and stop at
/// the batch size; right after a bulk load, stale statistics can make a bitmap scan and sort
/// look cheaper, and that costs time in proportion to the whole backlog on every claim.
pub(crate) const CLAIM_PLAN: &str = crate::sql::plan::INDEX_SCANS;

/// The columns of a message row that both engines read and turn into a [`Record`].
#[derive(QueryableByName)]
pub(crate) struct MessageColumns {
    #[diesel(sql_type = BigInt)]
    pub(crate) id: i64,
    #[diesel(sql_type = Text)]
    key: String,
    #[diesel(sql_type = Text)]
    topic: String,
    #[diesel(sql_type = Nullable<Text>)]
    pub(crate) aggregate_key: Option<String>,
    #[diesel(sql_type = Bytea)]
    payload: Vec<u8>,
    #[diesel(sql_type = Nullable<Text>)]
    content_type: Option<String>,
    /// As text: a jsonb value serde cannot hold (`1e400`, deep nesting) must fail this row
    /// alone, not the whole statement.
    #[diesel(sql_type = Text)]
    headers: String,
    /// `NULL` when chrono cannot hold it (`infinity`, or beyond the year 9999).
    #[diesel(sql_type = Nullable<Timestamptz>)]
    created_at: Option<DateTime<Utc>>,
}

impl MessageColumns {
    /// A well-formed row of `id` with `key`, for the engines' unit tests.
    #[cfg(test)]
    pub(crate) fn for_test(id: i64, key: &str, aggregate_key: Option<&str>) -> Self {
        MessageColumns {
            id,
            key: key.to_owned(),
            topic: "t".to_owned(),
            aggregate_key: aggregate_key.map(str::to_owned),
            payload: Vec::new(),
            content_type: None,
            headers: "{}".to_owned(),
            created_at: Some(Utc::now()),
        }
    }

    /// The row as a record on its `attempt`, and why it cannot be published when the
    /// columns that rows written by other means can spoil do not decode (the record is
    /// then still named by key and topic, for the dead letter).
    pub(crate) fn record(self, attempt: u32) -> (Record, Option<String>) {
        let (headers, created_at, undecodable) = match decode(self.created_at, &self.headers) {
            Ok((headers, created_at)) => (headers, created_at, None),
            Err(why) => (BTreeMap::new(), DateTime::UNIX_EPOCH, Some(why)),
        };
        let record = Record {
            id: self.id,
            key: self.key,
            topic: self.topic,
            aggregate_key: self.aggregate_key,
            payload: self.payload,
            content_type: self.content_type,
            headers,
            attempt,
            created_at,
        };
        (record, undecodable)
    }
}

fn decode(
    created_at: Option<DateTime<Utc>>,
    headers: &str,
) -> std::result::Result<(BTreeMap<String, String>, DateTime<Utc>), String> {
    let created_at = created_at.ok_or_else(|| {
        "undecodable row: created_at is not a time between the years 1 and 9999".to_owned()
    })?;
    Ok((decode_headers(headers)?, created_at))
}

fn decode_headers(text: &str) -> std::result::Result<BTreeMap<String, String>, String> {
    let map: serde_json::Map<String, serde_json::Value> = serde_json::from_str(text)
        .map_err(|e| format!("undecodable row: headers are not a JSON object of strings ({e})"))?;
    map.into_iter()
        .map(|(k, v)| match v {
            serde_json::Value::String(s) => Ok((k, s)),
            _ => Err(format!("undecodable row: header {k:?} is not a string")),
        })
        .collect()
}

/// An error as stored in `last_error`: NUL bytes removed, cut at a char boundary to at most
/// [`MAX_ERROR_BYTES`].
pub(crate) fn error_text(err: &dyn std::fmt::Display) -> String {
    let mut text = err.to_string().replace('\0', "");
    if text.len() > MAX_ERROR_BYTES {
        let mut cut = MAX_ERROR_BYTES;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_text_is_cut_at_a_char_boundary_without_nul() {
        let long = format!("a\0{}", "é".repeat(2_000));
        let text = error_text(&long);
        assert!(text.len() <= MAX_ERROR_BYTES);
        assert!(text.len() >= MAX_ERROR_BYTES - 1);
        assert!(!text.contains('\0'));
        assert!(text.starts_with("aé"));
    }

    #[test]
    fn headers_must_be_a_string_map_serde_can_hold() {
        assert_eq!(
            decode_headers(r#"{"a": "b"}"#).unwrap(),
            BTreeMap::from([("a".to_owned(), "b".to_owned())])
        );
        let not_string = decode_headers(r#"{"a": 1}"#).unwrap_err();
        assert!(
            not_string.contains(r#"header "a" is not a string"#),
            "{not_string}"
        );
        assert!(decode_headers(r#"["a"]"#).is_err());
        let huge = decode_headers(r#"{"n": 1e400}"#).unwrap_err();
        assert!(huge.contains("out of range"), "{huge}");
        let deep = format!(r#"{{"a": {}{}}}"#, "[".repeat(200), "]".repeat(200));
        assert!(decode_headers(&deep).unwrap_err().contains("recursion"));
    }
}
