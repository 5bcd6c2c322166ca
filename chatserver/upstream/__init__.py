"""The gateway: one client for every upstream call, one pure decoder per wire format (`chat` is
/v1/chat/completions, `messages` is Anthropic's /v1/messages), and the failure kinds; nothing
here knows conversations.
"""
