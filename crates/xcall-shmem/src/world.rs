//! A world of processing elements, its lifecycle and peer transports.
