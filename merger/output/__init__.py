"""merger/output"""
