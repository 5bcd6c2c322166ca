"""Every cent accounted for: each upstream request (a reply, a tool round, a title, a summary) is a
charge in the person's ledger, carrying where its cost came from; costs the gateway did not tell
are priced from our table or asked of the gateway's own bill afterwards; budgets are read from it.
"""
