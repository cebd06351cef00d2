//! Capture policies (Recapture, ExecUpdate, Disabled) and cache limits.
