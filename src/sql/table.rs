//! Table names: validation, quoting and the identifiers derived from them.

use crate::error::{Error, Result};

/// PostgreSQL truncates identifiers longer than this many bytes (NAMEDATALEN - 1).
const MAX_IDENT: usize = 63;

/// Suffixes of every object named after the table. The longest one bounds the name.
pub(crate) const SUFFIXES: &[&str] = &[
    "_pkey",
    "_key_unique",
    "_status_check",
    "_id_seq",
    "_pending_idx",
    "_aggregate_idx",
    "_sent_idx",
    "_dead_idx",
    "_inbox",
    "_inbox_pkey",
    "_inbox_processed_idx",
    "_migrations",
    "_migrations_pkey",
    "_relays",
    "_relays_pkey",
    "_logged_idx",
    "_cursor",
    "_cursor_pkey",
];

/// Suffix of the NOTIFY channel, which is built from the qualified name.
const CHANNEL_SUFFIX: &str = "_wake";

/// The first key of the wake lock an idle relay holds (`pg_advisory_lock(int, int)`); the
/// second is the outbox table's oid. "outw" in ASCII. See the crate docs, "Wake-up".
pub const WAKE_LOCK_CLASS: i32 = 0x6f75_7477;

/// A validated `name` or `schema.name`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TableName {
    schema: Option<String>,
    name: String,
}

impl TableName {
    pub(crate) fn parse(raw: &str) -> Result<Self> {
        let bad = |why: &str| Error::InvalidTable(format!("{raw:?}: {why}"));
        if raw.is_empty() {
            return Err(bad("the name is empty"));
        }
        let parts: Vec<&str> = raw.split('.').collect();
        if parts.len() > 2 {
            return Err(bad("expected `name` or `schema.name`"));
        }
        for part in &parts {
            check_part(part).map_err(|why| bad(&why))?;
        }
        let (schema, name) = match parts.as_slice() {
            [name] => (None, (*name).to_owned()),
            [schema, name] => (Some((*schema).to_owned()), (*name).to_owned()),
            _ => unreachable!("split yields one or two parts here"),
        };
        let table = TableName { schema, name };
        let longest = SUFFIXES.iter().map(|s| s.len()).max().unwrap_or(0);
        if table.name.len() + longest > MAX_IDENT {
            return Err(bad(&format!(
                "derived identifiers such as `{}` would exceed PostgreSQL's {MAX_IDENT}-byte limit; \
                 keep the table part within {} bytes",
                format_args!("{}_inbox_processed_idx", table.name),
                MAX_IDENT - longest
            )));
        }
        if table.channel().len() > MAX_IDENT {
            return Err(bad(&format!(
                "the NOTIFY channel `{}` would exceed PostgreSQL's {MAX_IDENT}-byte limit; \
                 keep `schema.name` within {} bytes",
                table.channel(),
                MAX_IDENT - CHANNEL_SUFFIX.len()
            )));
        }
        Ok(table)
    }

    /// The name as the user wrote it: `name` or `schema.name`.
    pub(crate) fn display(&self) -> String {
        match &self.schema {
            Some(schema) => format!("{schema}.{}", self.name),
            None => self.name.clone(),
        }
    }

    pub(crate) fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// The quoted, qualified name of the table itself.
    pub(crate) fn quoted(&self) -> String {
        self.quoted_with("")
    }

    /// The quoted, qualified name of a table derived with `suffix` (same schema).
    pub(crate) fn quoted_with(&self, suffix: &str) -> String {
        match &self.schema {
            Some(schema) => format!("\"{schema}\".\"{}{suffix}\"", self.name),
            None => format!("\"{}{suffix}\"", self.name),
        }
    }

    /// The quoted bare name of an index or constraint derived with `suffix`.
    pub(crate) fn object(&self, suffix: &str) -> String {
        debug_assert!(SUFFIXES.contains(&suffix), "unlisted suffix {suffix}");
        format!("\"{}{suffix}\"", self.name)
    }

    /// The NOTIFY channel (unquoted; quote it for LISTEN).
    pub(crate) fn channel(&self) -> String {
        format!("{}{CHANNEL_SUFFIX}", self.display())
    }

    /// The table's oid as the wake lock's second key: the same whatever the spelling of the
    /// name, resolved when the statement is planned.
    pub(crate) fn wake_lock_oid(&self) -> String {
        format!("'{}'::regclass::oid::int4", self.quoted())
    }

    /// Both keys of the wake lock, for `pg_*advisory*_lock(int, int)`.
    pub(crate) fn wake_lock_key(&self) -> String {
        format!("{WAKE_LOCK_CLASS}, {}", self.wake_lock_oid())
    }
}

fn check_part(part: &str) -> std::result::Result<(), String> {
    let mut chars = part.chars();
    match chars.next() {
        None => return Err("a part of the name is empty".into()),
        Some(c) if c == '_' || c.is_ascii_lowercase() => {}
        Some(c) => {
            return Err(format!(
                "each part must start with a lowercase letter or `_`, found {c:?}"
            ));
        }
    }
    if let Some(c) = chars.find(|c| !(*c == '_' || c.is_ascii_lowercase() || c.is_ascii_digit())) {
        return Err(format!(
            "each part may only hold lowercase letters, digits and `_`, found {c:?}"
        ));
    }
    if part.len() > MAX_IDENT {
        return Err(format!(
            "a part exceeds PostgreSQL's {MAX_IDENT}-byte limit"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_and_qualified() {
        let t = TableName::parse("orders_outbox").unwrap();
        assert_eq!(t.quoted(), "\"orders_outbox\"");
        assert_eq!(t.quoted_with("_inbox"), "\"orders_outbox_inbox\"");
        assert_eq!(t.channel(), "orders_outbox_wake");
        let t = TableName::parse("app.outbox").unwrap();
        assert_eq!(t.quoted(), "\"app\".\"outbox\"");
        assert_eq!(t.object("_pkey"), "\"outbox_pkey\"");
        assert_eq!(t.channel(), "app.outbox_wake");
    }

    #[test]
    fn rejects_bad_names() {
        for bad in [
            "", "Outbox", "1outbox", "out;box", "out\"box", "a.b.c", ".outbox", "app.", "out box",
            "outbøx",
        ] {
            let err = TableName::parse(bad).unwrap_err();
            assert!(matches!(err, Error::InvalidTable(_)), "{bad:?} gave {err}");
        }
    }

    #[test]
    fn length_limits_name_the_limit() {
        let longest = SUFFIXES.iter().map(|s| s.len()).max().unwrap();
        let ok = "a".repeat(MAX_IDENT - longest);
        TableName::parse(&ok).unwrap();
        let err = TableName::parse(&format!("{ok}a")).unwrap_err().to_string();
        assert!(err.contains("63-byte"), "{err}");
        let schema = "s".repeat(40);
        let err = TableName::parse(&format!("{schema}.{ok}"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("NOTIFY channel"), "{err}");
    }
}
