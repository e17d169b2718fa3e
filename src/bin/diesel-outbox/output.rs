//! Where commands write: JSON or human text, to any writer, so that commands run in
//! process (in tests) as well as in the binary.

use std::io::Write;

use crate::Failure;

/// A command's output.
pub(crate) struct Output<'a> {
    json: bool,
    out: &'a mut dyn Write,
}

impl<'a> Output<'a> {
    pub(crate) fn new(json: bool, out: &'a mut dyn Write) -> Self {
        Output { json, out }
    }

    /// Prints `value` as JSON with `--json`, otherwise what `human` says.
    pub(crate) fn print(
        &mut self,
        value: serde_json::Value,
        human: impl FnOnce() -> String,
    ) -> Result<(), Failure> {
        let text = if self.json {
            value.to_string()
        } else {
            human()
        };
        writeln!(self.out, "{text}").map_err(|e| Failure::new(1, format!("cannot write: {e}")))
    }
}
