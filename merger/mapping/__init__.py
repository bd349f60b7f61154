"""merger/mapping"""
