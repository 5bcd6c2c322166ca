"""The conversation document's rules that do not depend on where it is stored: branches, import and
export, presets, memory facts, PII masking.
"""
