"""Capture sizes and length buckets, as seen from the capture layer.

They live in `graphattn.buckets` (below the backends, which size plans by
them); this module keeps the names at their capture-layer path.
"""

from graphattn.buckets import (
    BucketPolicy,
    LengthBuckets,
    PaddingStats,
    default_capture_sizes,
    pad_to_capture_size,
    validate_sizes,
)

__all__ = ["BucketPolicy", "LengthBuckets", "PaddingStats", "default_capture_sizes",
           "pad_to_capture_size", "validate_sizes"]
