//! The exact call key: (platform, device, target, attribute digest, buffers).
