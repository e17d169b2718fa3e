//! Histogram buckets as `relay --metrics-buckets` takes them: upper bounds in seconds,
//! separated by commas (`0.005,0.01,0.1,1`).

use std::fmt;
use std::str::FromStr;

/// The upper bounds of a histogram's buckets, in seconds: at least one, each positive and
/// finite, in strictly increasing order (the exporter adds `+Inf` itself).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Buckets(pub(crate) Vec<f64>);

impl FromStr for Buckets {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut bounds: Vec<f64> = Vec::new();
        for written in s.split(',').map(str::trim) {
            if written.is_empty() {
                return Err(
                    "a bucket bound is empty (write them separated by commas: 0.005,0.01,0.1)"
                        .into(),
                );
            }
            let bound: f64 = written
                .parse()
                .map_err(|_| format!("{written:?} is not a number of seconds"))?;
            if !bound.is_finite() {
                return Err(format!("the bucket bound {written} is not finite"));
            }
            if bound <= 0.0 {
                return Err(format!("the bucket bound {written} is not positive"));
            }
            if let Some(&before) = bounds.last()
                && bound <= before
            {
                return Err(format!(
                    "the bucket bound {written} follows {before}: the bounds must be strictly \
                     increasing"
                ));
            }
            bounds.push(bound);
        }
        Ok(Buckets(bounds))
    }
}

impl fmt::Display for Buckets {
    /// As written on the command line: `0.001,0.0025,...,60`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, bound) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{bound}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_positive_finite_and_strictly_increasing() {
        assert_eq!(
            "0.005, 0.01,0.5,1,2.5,60".parse::<Buckets>(),
            Ok(Buckets(vec![0.005, 0.01, 0.5, 1.0, 2.5, 60.0]))
        );
        assert_eq!("1e-3".parse::<Buckets>(), Ok(Buckets(vec![0.001])));
        for (written, says) in [
            ("", "empty"),
            ("0.1,,1", "empty"),
            ("0.1,1,", "empty"),
            ("0.1,fast", "\"fast\" is not a number"),
            ("0,1", "0 is not positive"),
            ("-0.5,1", "-0.5 is not positive"),
            ("-0,1", "-0 is not positive"),
            ("0.1,inf", "inf is not finite"),
            ("NaN", "NaN is not finite"),
            (
                "0.1,0.05",
                "0.05 follows 0.1: the bounds must be strictly increasing",
            ),
            ("0.1,0.1", "strictly increasing"),
        ] {
            let err = written.parse::<Buckets>().unwrap_err();
            assert!(err.contains(says), "{written:?}: {err}");
        }
    }

    #[test]
    fn the_default_shown_in_help_parses_back_to_itself() {
        let default = Buckets(diesel_outbox::defaults::HISTOGRAM_BUCKETS.to_vec());
        assert_eq!(
            default.to_string(),
            "0.001,0.0025,0.005,0.01,0.025,0.05,0.1,0.25,0.5,1,2.5,5,10,30,60"
        );
        assert_eq!(default.to_string().parse::<Buckets>(), Ok(default));
    }
}
