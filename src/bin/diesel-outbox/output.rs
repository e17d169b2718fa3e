//! Where commands write: JSON or human text, to any writer, so that commands run in
//! process (in tests) as well as in the binary.

use std::io::Write;

use crate::Failure;

/// A command's output.
pub(crate) struct Output<'a> {
    json: bool,
    out: &'a mut dyn Write,
    terminal: bool,
}

impl<'a> Output<'a> {
    pub(crate) fn new(json: bool, out: &'a mut dyn Write, terminal: bool) -> Self {
        Output {
            json,
            out,
            terminal,
        }
    }

    /// Clears a terminal's screen for a redraw (nothing for JSON, or when not a terminal).
    pub(crate) fn clear(&mut self) -> Result<(), Failure> {
        if self.terminal && !self.json {
            write!(self.out, "\x1b[2J\x1b[H")
                .and_then(|()| self.out.flush())
                .map_err(|e| Failure::new(1, format!("cannot write: {e}")))?;
        }
        Ok(())
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
        writeln!(self.out, "{text}")
            .and_then(|()| self.out.flush())
            .map_err(|e| Failure::new(1, format!("cannot write: {e}")))
    }
}
